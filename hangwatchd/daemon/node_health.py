"""Is the node at fault? What the daemon knows of it (``health.json``), and ``hangwatchd health``'s judgement.

Node Problem Detector (and NVIDIA's device plugin, NVSentinel) take a node out
of scheduling on a node condition. A node condition must mean the node is at
fault: a GPU that needs a reset or is gone, or a watchdog that cannot watch
(not running, its loop stalled, py-spy or ptrace unusable). A job's own hang is
never one: it surfaces through the GPUProcessHung alert and its incident.

The daemon writes ``RUNTIME_DIR/health.json`` at start and on each GPU fault:
the GPU-event thread posts each event to the loop's queue, the loop counts it
and hands the file's new content to the status writer's thread. The loop's own
liveness is the age of ``status.json``, which the loop rewrites every few seconds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..host import gpu_events
from ..host.gpu_events import GpuEvent
from ..host.pyspy_binary import find_pyspy, ptrace_hint
from ..metrics import Metrics, xid_label
from ..workload import runtime_files
from .status_file import STATUS_EVERY

HEALTH_FILE = "health.json"
LOOP_STALLED_AFTER = max(30.0, 10 * STATUS_EVERY)  # seconds without a status.json from the loop
MAX_FAULTS = 64  # GPU faults kept in the file (the newest): one a GPU is what matters
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
                                     "gpu_events": None}

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
        self.data["gpu_faults"] = (self.data["gpu_faults"] + [event.to_json()])[-MAX_FAULTS:]
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


class NodeHealth:
    """The daemon's side: the GPU-event listener on its thread (posting to the loop), the health file, the XID counter."""

    def __init__(self, runtime_dir: Path, metrics: Metrics, post: Callable[[object], None],
                 write: Callable[[Path, dict[str, Any]], None] | None = None, nvml: Any = None) -> None:
        self.file = HealthFile(runtime_dir, write)
        self.metrics = metrics
        self.listener = gpu_events.Listener(gpu_events.RECORDER, post, nvml=nvml)

    def start(self) -> None:
        self.file.start(capture_problem())
        self.listener.start()

    def stop(self) -> None:
        self.listener.stop()
        self.file.remove()

    def gpus_found(self, found: gpu_events.GpusFound) -> None:  # on the loop
        self.metrics.gpus_seen(list(found.gpus))
        self.file.gpus(list(found.gpus))

    def gpu_event(self, event: GpuEvent) -> None:  # on the loop
        if not event.lost:
            self.metrics.xid_errors.labels(**self.metrics.labels(gpu=str(event.gpu), xid=xid_label(event.xid))).inc()
        self.file.gpu_event(event)


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
            by_gpu[f.get("gpu")] = f  # the newest per GPU
        parts = [f"GPU {g} {'is lost' if f.get('lost') else 'reported XID %s (%s)' % (f.get('xid'), f.get('what'))} at "
                 f"{time.strftime('%H:%M:%SZ', time.gmtime(float(f.get('time') or 0)))}" for g, f in sorted(by_gpu.items(), key=str)]
        return Health(PROBLEM, "; ".join(parts) + ": the GPU needs a reset (drain the node, then reset or reboot)")
    if health.get("capture_problem"):
        return Health(PROBLEM, f"hangwatchd cannot capture hangs: {health['capture_problem']}")
    hung = [p for p in status.get("processes") or [] if isinstance(p, dict) and p.get("state") in ("hung", "captured")]
    gpus = health.get("gpus")
    line = f"hangwatchd watches {len(status.get('processes') or [])} processes"
    line += f", {len(gpus)} GPUs without faults" if isinstance(gpus, list) else ""
    if hung:  # a job's own hang: the job's problem, surfaced by its alert and incident, never the node's
        line += f"; {len(hung)} hung process(es) of jobs, not a node fault (see hangwatchd status)"
    return Health(OK, line)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
