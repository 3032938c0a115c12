"""Is the node at fault? What the daemon knows of it (``health.json``), and ``hangwatchd health``'s judgement.

Node Problem Detector (and NVIDIA's device plugin, NVSentinel) take a node out
of scheduling on a node condition. A node condition must mean the node is at
fault: a GPU that needs a reset or is gone (NVIDIA's catalogue, or the recovery
action NVML reports), a GPU that different jobs keep failing on (the ledger of
suspects: ``suspect_jobs`` different jobs within ``suspect_window``), or a
watchdog that cannot watch (not running, its loop stalled, py-spy or ptrace
unusable). A job's own hang, or a program's own GPU fault (XID 13, 31, 43), is
never one: it surfaces through its alert and its incident.

The daemon writes ``RUNTIME_DIR/health.json`` at start, on each GPU fault and
on each change of its GPUs' standing in the ledger: the GPU-event threads
(NVML's, the kernel log's) post each event to the loop's queue, and the store
posts each ledger entry it writes; the loop counts them and hands the file's
new content to the status writer's thread. The loop's own liveness is the age
of ``status.json``, which the loop rewrites every few seconds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ..host import gpu_events
from ..host.gpu_events import GpuEvent
from ..host.pyspy_binary import find_pyspy, ptrace_hint
from ..incidents import ledger
from ..metrics import Metrics, xid_label
from ..workload import runtime_files
from .status_file import STATUS_EVERY

log = structlog.get_logger("hangwatchd.gpu")

HEALTH_FILE = "health.json"
LOOP_STALLED_AFTER = max(30.0, 10 * STATUS_EVERY)  # seconds without a status.json from the loop
MAX_FAULTS = 64  # GPU faults kept in the file (the newest): one a GPU is what matters
MAX_IMPLICATED = 256  # ledger entries of this node within suspect_window kept (the newest)
CAP_SYS_PTRACE = 19

# NPD's custom plugin contract: 0 OK, 1 a problem, anything else unknown.
OK, PROBLEM, UNKNOWN = 0, 1, 3


def capture_problem() -> str | None:
    """Why py-spy cannot read the node's processes, or None: found once at start (nothing changes it but the admin)."""
    if find_pyspy() is None:
        return "py-spy is not installed (or $HANGWATCHD_PYSPY=none): hung processes get no stacks; pip install py-spy"
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        scope = None
    if scope == "3":
        return "kernel.yama.ptrace_scope=3 forbids ptrace even for root: py-spy cannot read any process"
    if os.geteuid() == 0 and scope not in (None, "0"):
        status = Path("/proc/self/status").read_text()
        cap = next((int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith("CapEff:")), 0)
        if not cap >> CAP_SYS_PTRACE & 1:
            return f"no CAP_SYS_PTRACE: py-spy cannot read other users' processes; {ptrace_hint()}"
    return None


class HealthFile:
    """health.json: the daemon's facts about the node, rewritten whole (on the loop; ``write`` puts it on disk)."""

    def __init__(self, runtime_dir: Path, write: Callable[[Path, dict[str, Any]], None] | None = None) -> None:
        self.path = runtime_dir / HEALTH_FILE
        self.write = write or _write_now
        self.data: dict[str, Any] = {"pid": os.getpid(), "capture_problem": None, "gpu_faults": [], "gpus": None,
                                     "gpu_events": None, "implicated": [], "suspect_jobs": None, "suspect_window": None}

    def start(self, capture: str | None) -> None:
        self.data["capture_problem"] = capture
        _write_now(self.path, {**self.data, "time": time.time()})  # at start, before clients look: at once

    def gpus(self, gpus: list[int], unavailable: str | None = None) -> None:
        self.data["gpus"] = gpus
        self.data["gpu_events"] = unavailable
        self._write()

    def gpu_event(self, event: GpuEvent) -> None:
        if not event.node_fault:
            return  # a job's own error (13, 31, 43): in its incident, never a node condition
        kept = [f for f in self.data["gpu_faults"]
                if (f.get("gpu"), f.get("pci"), f.get("xid")) != (event.gpu, event.pci, event.xid)
                or abs(float(f.get("time") or 0) - event.time) > gpu_events.MERGE_S]  # NVML's and the kernel's report: one
        self.data["gpu_faults"] = (kept + [event.to_json()])[-MAX_FAULTS:]
        self._write()

    def implicated(self, rows: list[dict[str, Any]], jobs: int, window: float) -> None:
        if rows != self.data["implicated"] or self.data["suspect_jobs"] != jobs:
            self.data.update(implicated=rows, suspect_jobs=jobs, suspect_window=window)
            self._write()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        self.write(self.path, {**self.data, "time": time.time()})


def _write_now(path: Path, data: dict[str, Any]) -> None:
    try:
        runtime_files.write_json(path, data)
    except OSError:
        pass  # the runtime dir is gone: health says unknown, which is right


@dataclass(frozen=True)
class LedgerChanged:
    """The store wrote (or took away: ``entry`` None) an incident's entry in the ledger of suspects."""

    incident: str
    entry: dict[str, Any] | None


@dataclass(frozen=True)
class Suspicions:
    """How the ledger thinks of the node's GPUs: ``suspect_jobs`` different jobs within ``suspect_window``."""

    jobs: int = 2
    window: float = 86400.0


class NodeHealth:
    """The daemon's side: the GPU-event threads (NVML's, the kernel log's; posting to the loop), the health
    file, the XID counter, and this node's GPUs as the ledger implicates them (their gauges)."""

    def __init__(self, runtime_dir: Path, metrics: Metrics, post: Callable[[object], None],
                 write: Callable[[Path, dict[str, Any]], None] | None = None, nvml: Any = None, kernel_log: str = "",
                 node: str = "", state_dir: Path | None = None, suspicions: Suspicions = Suspicions()) -> None:
        self.file = HealthFile(runtime_dir, write)
        self.metrics = metrics
        self.recorder = gpu_events.RECORDER
        poster = gpu_events.Poster(post)
        self.listener = gpu_events.Listener(self.recorder, poster, nvml=nvml)
        self.kernel = gpu_events.KernelXids(kernel_log, self.recorder, poster) if kernel_log else None
        if not kernel_log:
            self.recorder.kernel_log = 'not read (kernel_log = "" in the config)'
        self.node = node
        self.state_dir = state_dir
        self.suspicions = suspicions
        self.entries: dict[str, dict[str, Any]] = {}  # incident -> its ledger entry, this node's, within the window
        self.exported: dict[str, tuple[str, str]] = {}  # GPU (its ledger key) -> the (gpu, UUID) labels of its gauges

    def start(self) -> None:
        self.file.start(capture_problem())
        if self.state_dir is not None:  # what implicated this node's GPUs before this start, still within the window
            try:
                found = ledger.read(self.state_dir, time.time() - self.suspicions.window)
            except ledger.LedgerError as exc:
                found = []
                log.error("ledger_unreadable", error=str(exc))
            for entry in found[-MAX_IMPLICATED:]:
                self._keep(entry["incident"], entry)
        self.listener.start()
        if self.kernel is not None:
            self.kernel.start()
        self._judge(time.time())

    def stop(self) -> None:
        self.listener.stop()
        if self.kernel is not None:
            self.kernel.stop()
        self.file.remove()

    def gpus_found(self, found: gpu_events.GpusFound) -> None:  # on the loop
        self.metrics.gpus_seen(list(found.gpus), {gi.index: gi.uuid for gi in found.infos if gi.index is not None and gi.uuid})
        self.file.gpus(list(found.gpus))

    def gpu_event(self, event: GpuEvent, job: str | None = None, rank: int | None = None) -> None:  # on the loop
        if job is not None:
            self.recorder.name(event, job, rank)  # for the incidents of other processes on that GPU
        if not event.lost and not event.update:  # the other source's report of one XID adds facts, not a count
            gpu = str(event.gpu) if event.gpu is not None else ""
            self.metrics.xid_errors.labels(**self.metrics.labels(gpu=gpu, xid=xid_label(event.xid))).inc()
        self.file.gpu_event(event)

    def ledger_changed(self, changed: LedgerChanged) -> None:  # on the loop
        self.entries.pop(changed.incident, None)
        if changed.entry is not None:
            self._keep(changed.incident, changed.entry)
        self._judge(time.time())

    def expire(self, now: float) -> None:  # on the loop, every few seconds: the window moves on
        since = now - self.suspicions.window
        if any(e["time"] < since for e in self.entries.values()):
            self.entries = {k: e for k, e in self.entries.items() if e["time"] >= since}
            self._judge(now)

    def _keep(self, incident: str, entry: dict[str, Any]) -> None:
        if any((b.get("node") or entry.get("node")) == self.node for b in entry.get("blames") or []):
            self.entries[incident] = entry
            while len(self.entries) > MAX_IMPLICATED:
                self.entries.pop(min(self.entries, key=lambda k: self.entries[k]["time"]))

    def _judge(self, now: float) -> None:
        """The gauges of this node's GPUs and the health file's rows, from the entries within the window."""
        gpus = ledger.implicating_jobs(self.entries.values(), self.node, now - self.suspicions.window)
        for key, g in gpus.items():
            labels = (str(g["index"]) if g["index"] is not None else "", g["uuid"] or "")
            old = self.exported.get(key)
            if old is not None and old != labels:
                self._zero(old)
            self.exported[key] = labels
            jobs = len(g["jobs"])
            self.metrics.gpu_implicating_jobs.labels(**self.metrics.labels(gpu=labels[0], UUID=labels[1])).set(jobs)
            self.metrics.gpu_suspect.labels(**self.metrics.labels(gpu=labels[0], UUID=labels[1])).set(
                1 if jobs >= self.suspicions.jobs else 0)
        for key in [k for k in self.exported if k not in gpus]:
            self._zero(self.exported.pop(key))
        rows = [{"time": e["time"], "incident": e["incident"], "job": e.get("job"), "job_key": e["job_key"],
                 "user": e.get("user"), "kind": b["kind"], "xid": b.get("xid"), "gpu": b.get("gpu"), "uuid": b.get("uuid"),
                 "serial": b.get("serial"), "pci": b.get("pci"), "why": b.get("why")}
                for e in sorted(self.entries.values(), key=lambda e: e["time"]) for b in e["blames"]
                if (b.get("node") or e.get("node")) == self.node]
        self.file.implicated(rows[-MAX_IMPLICATED:], self.suspicions.jobs, self.suspicions.window)

    def _zero(self, labels: tuple[str, str]) -> None:
        self.metrics.gpu_implicating_jobs.labels(**self.metrics.labels(gpu=labels[0], UUID=labels[1])).set(0)
        self.metrics.gpu_suspect.labels(**self.metrics.labels(gpu=labels[0], UUID=labels[1])).set(0)


@dataclass(frozen=True)
class Health:
    code: int  # OK, PROBLEM or UNKNOWN
    line: str  # one line for NPD's condition message


def judge(runtime_dir: Path, stalled_after: float = LOOP_STALLED_AFTER, now: float | None = None) -> Health:
    """The node's health as NPD's custom plugin reports it: a problem only when the node is at fault."""
    now = time.time() if now is None else now
    info = runtime_files.daemon_info(runtime_dir)
    if info is None:
        return Health(PROBLEM, f"hangwatchd is not running (runtime dir {runtime_dir}): hung GPU jobs on this node go unnoticed")
    status = runtime_files.status(runtime_dir)
    health = _read(runtime_dir / HEALTH_FILE)
    if status is None or health is None:
        return Health(UNKNOWN, f"hangwatchd runs (pid {info.get('pid')}) but its status or health file in {runtime_dir} is unreadable")
    age = now - float(status.get("time") or 0)
    if age > stalled_after:
        return Health(PROBLEM, f"hangwatchd's loop has not run for {age:.0f} s (pid {info.get('pid')}): it cannot watch; "
                               "restart it (systemctl restart hangwatchd)")
    faults = [f for f in health.get("gpu_faults") or [] if isinstance(f, dict)]
    if faults:
        by_gpu: dict[Any, dict[str, Any]] = {}
        for f in faults:
            by_gpu[f.get("gpu") if f.get("gpu") is not None else f"at PCI {f.get('pci')}"] = f  # the newest per GPU
        parts = [f"GPU {g} {'is lost' if f.get('lost') else 'reported XID %s (%s)' % (f.get('xid'), f.get('what'))}"
                 + (f" (recovery action: {f['recovery_action']})" if f.get("recovery_action") not in (None, "none") else "")
                 + f" at {time.strftime('%H:%M:%SZ', time.gmtime(float(f.get('time') or 0)))}"
                 for g, f in sorted(by_gpu.items(), key=str)]
        return Health(PROBLEM, "; ".join(parts) + ": the GPU needs a reset (drain the node, then reset or reboot)")
    suspect = _suspect_gpus(health, now)
    if suspect:
        return Health(PROBLEM, suspect)
    if health.get("capture_problem"):
        return Health(PROBLEM, f"hangwatchd cannot capture hangs: {health['capture_problem']}")
    hung = [p for p in status.get("processes") or [] if isinstance(p, dict) and p.get("state") in ("hung", "captured")]
    gpus = health.get("gpus")
    line = f"hangwatchd watches {len(status.get('processes') or [])} processes"
    line += f", {len(gpus)} GPUs without faults" if isinstance(gpus, list) else ""
    if hung:  # a job's own hang: the job's problem, surfaced by its alert and incident, never the node's
        line += f"; {len(hung)} hung process(es) of jobs, not a node fault (see hangwatchd status)"
    return Health(OK, line)


def _suspect_gpus(health: dict[str, Any], now: float) -> str | None:
    """The GPUs of this node implicated by at least suspect_jobs different jobs within suspect_window, in one line."""
    jobs, window = health.get("suspect_jobs"), health.get("suspect_window")
    if not isinstance(jobs, int) or not isinstance(window, (int, float)):
        return None
    by_gpu: dict[str, list[dict[str, Any]]] = {}
    for r in health.get("implicated") or []:
        if isinstance(r, dict) and isinstance(r.get("time"), (int, float)) and r["time"] >= now - window:
            by_gpu.setdefault(str(r.get("uuid") or r.get("pci") or r.get("gpu")), []).append(r)
    parts = []
    for rows in by_gpu.values():
        names = list(dict.fromkeys(str(r.get("job") or r.get("job_key")) for r in rows))
        distinct = len({r.get("job_key") for r in rows})
        if distinct < jobs:
            continue
        last = rows[-1]
        gpu = f"GPU {last['gpu']}" if last.get("gpu") is not None else "a GPU"
        ids = ", ".join(str(x) for x in (last.get("uuid"), f"serial {last['serial']}" if last.get("serial") else None) if x)
        xid_list = ", ".join(dict.fromkeys(f"XID {r['xid']}" for r in rows if r.get("xid") is not None)) or "a lost GPU"
        parts.append(f"{gpu}{f' ({ids})' if ids else ''} was implicated by {distinct} different jobs in "
                     f"{window / 3600:g} h ({', '.join(names[:4])}; {xid_list})")
    if not parts:
        return None
    return "; ".join(parts) + ": suspect the GPU, not the jobs; drain the node and run diagnostics (dcgmi diag -r 3)"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
