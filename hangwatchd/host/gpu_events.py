"""The node's GPU faults as they happen: XIDs from NVML's events and from the kernel log, recorded while the daemon runs.

An XID is the driver's report of a GPU error (79: the GPU fell off the bus; 48:
a double-bit ECC error; 31: a program's illegal address). Two sources, each on
a thread of its own, neither ever touching the loop:

- NVML's events (``Listener``): GPU N reported XID X. NVML only tells a
  listener registered *before* the error, so the daemon listens from its
  start; ``nvmlEventSetWait`` blocks (with a timeout) in the driver. After each
  event the listener asks NVML for the GPU's recovery action (reset, reboot,
  drain), where the driver has one.
- The kernel log (``KernelXids`` over ``host/kmsg.py``): the same XID with the
  process whose channel it was (``pid=2149, name=python3``), the GPU by PCI
  address, and what the driver adds ("caused by previous Xid 149").

The two reports of one XID are one event (``Recorder.add``: the same GPU and
XID within ``MERGE_S``), kept in a bounded list (the newest win), each posted
to the loop's queue as a frozen ``GpuEvent``: counted there once
(``hangwatchd_gpu_xid_errors_total``), told to the health file, and named with
the job of the process it names when that process is watched. A capture
writes the events of the GPUs its processes ran on beside them
(``gpu-events.json``, ``attach``); the analysis (``analyze/gpu_events.py``)
decides whose fault each was, by NVIDIA's catalogue (``host/xid.py``).

The seam is NVML's own API: the listener takes the ``pynvml`` module (or any
object with its functions), so a test feeds it real ``c_nvmlEventData_t``
records without a GPU; the kernel log is any path (a FIFO in the tests).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from . import procfs
from . import xid as xids
from .kmsg import KernelLog

if TYPE_CHECKING:
    from ..model import ProcessId

log = structlog.get_logger("hangwatchd.gpu")

MAX_EVENTS = 1024  # the newest kept: a flapping GPU cannot grow the daemon
WAIT_MS = 1000  # how long one wait in the driver lasts before the listener looks at its stop flag
MERGE_S = 10.0  # NVML's event and the kernel log's line of one XID on one GPU come within this many seconds
MERGE_LOOK = 64  # the newest events an arriving one may be the other report of
BURST_S = 1.0  # the kernel log's lines of one report (an XID 13 is three: warp, SM, ESR) come within this
POSTS_PER_S, POSTS_BURST = 50.0, 200  # events posted to the loop: a flood is recorded, counted in the log, not posted
DEVICE = re.compile(r"/dev/nvidia(\d+)$")
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")  # one directory a GPU, by PCI address: its minor number and UUID


def describe(xid: int) -> str:
    return xids.describe(xid)


def needs_reset(xid: int) -> bool:
    return xids.needs_reset(xid)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of the node, as the listener (or the driver's /proc files) found it."""

    index: int | None  # NVML's
    minor: int | None = None  # /dev/nvidiaMINOR, how a process's open files name the GPU
    uuid: str | None = None
    serial: str | None = None  # the board's serial number: what a vendor's RMA asks for
    pci: str | None = None  # xid.pci_key(): how the kernel log names it


@dataclass(frozen=True)
class GpuEvent:
    """One XID on one GPU, at a wall-clock time (NVML gives none: the time it was received; the kernel
    log's own timestamp where the line came from there)."""

    time: float
    gpu: int | None  # NVML's index; None: a kernel log line for a GPU no source could index
    xid: int
    uuid: str | None = None
    minor: int | None = None
    lost: bool = False  # the GPU stopped answering NVML at all
    pci: str | None = None
    serial: str | None = None
    pid: int | None = None  # the process the driver named (the kernel log); None where it named none
    process: str | None = None  # the name of its thread, as the driver logged it
    start_time: int | None = None  # that pid's start time when the line was read: (pid, start time) is the process
    uid: int | None = None  # and its owner then
    detail: str | None = None  # the rest of the kernel log line
    cause: int | None = None  # "caused by previous Xid N"
    recovery: int | None = None  # the recovery action NVML reports (or XID 154 logs): xid.RECOVERY_ACTIONS
    source: str = "nvml"  # "nvml", "kmsg", or "nvml+kmsg" when both reported it
    job: str | None = None  # the job of the process it names, where that process is watched here
    rank: int | None = None
    update: bool = False  # posted again with more facts (the other source's, its job): counted once, at its first post

    @property
    def kind(self) -> str:
        """Whose fault: xid.APPLICATION (the program's own), xid.GPU (the GPU's or the node's), xid.UNKNOWN."""
        return xids.GPU if self.lost else xids.kind(self.xid, self.cause)

    @property
    def what(self) -> str:
        return "GPU is lost (stopped answering NVML)" if self.lost else describe(self.xid)

    @property
    def node_fault(self) -> bool:
        """The GPU is out of service until it is reset (or the node rebooted): the node's condition."""
        return self.lost or needs_reset(self.xid) or (self.recovery is not None and self.recovery != 0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "what": self.what, "needs_reset": self.node_fault, "kind": self.kind,
                "recovery_action": xids.recovery_name(self.recovery)}


class Recorder:
    """The events seen since the daemon started, bounded; the node's GPUs; read and written from any thread."""

    def __init__(self, limit: int = MAX_EVENTS) -> None:
        self._events: collections.deque[GpuEvent] = collections.deque(maxlen=limit)
        self._lock = threading.Lock()
        self.gpus: dict[int, int | None] = {}  # index -> minor number, once the listener found them
        self.infos: dict[int, GpuInfo] = {}  # index -> what NVML says of it
        self.unavailable: str | None = None  # why NVML is not listened to (no driver, no GPU)
        self.kernel_log: str | None = None  # why the kernel log is not read (None: it is, or it was not asked for)

    def add(self, event: GpuEvent) -> GpuEvent:
        """Keep ``event``; the other source's report of the same XID (same GPU, ``MERGE_S``) takes
        its facts instead, and comes back marked ``update``; so does another line of one report
        (the driver logs an XID 13 in several lines, ``BURST_S`` apart at most)."""
        with self._lock:
            for i in range(len(self._events) - 1, max(-1, len(self._events) - 1 - MERGE_LOOK), -1):
                old = self._events[i]
                if _burst(old, event):
                    return dataclasses.replace(old, update=True)
                if _same(old, event):
                    merged = _merge(old, event)
                    self._events[i] = merged
                    return merged
            self._events.append(event)
            return event

    def name(self, event: GpuEvent, job: str | None, rank: int | None) -> GpuEvent:
        """The job (and rank) of the watched process an event names, told by the loop, which knows them."""
        with self._lock:
            for i in range(len(self._events) - 1, -1, -1):
                old = self._events[i]
                if old.time == event.time and old.xid == event.xid and old.pid == event.pid:
                    self._events[i] = dataclasses.replace(old, job=job, rank=rank)
                    return self._events[i]
        return event

    def events(self) -> list[GpuEvent]:
        with self._lock:
            return list(self._events)

    def index_of_minor(self, minor: int) -> int | None:
        return next((i for i, m in self.gpus.items() if m == minor), None)

    def info(self, index: int | None = None, pci: str | None = None) -> GpuInfo | None:
        """What is known of a GPU, by NVML's index or by its PCI address (NVML first, then the driver's /proc)."""
        for gi in list(self.infos.values()):
            if (index is not None and gi.index == index) or (pci is not None and gi.pci == pci):
                return gi
        if pci is not None:
            found = driver_gpu(pci)
            if found is not None:
                return dataclasses.replace(found, index=self.index_of_minor(found.minor) if found.minor is not None else None)
        return None


def _burst(old: GpuEvent, new: GpuEvent) -> bool:
    """Another kernel log line of the report ``old`` is: the same GPU, XID, process and cause, within BURST_S."""
    return ("kmsg" in old.source and new.source == "kmsg" and (old.pci, old.xid, old.pid, old.cause) ==
            (new.pci, new.xid, new.pid, new.cause) and abs(old.time - new.time) <= BURST_S)


def _same(old: GpuEvent, new: GpuEvent) -> bool:
    if old.xid != new.xid or old.lost or new.lost or abs(old.time - new.time) > MERGE_S:
        return False
    if "kmsg" in old.source and "kmsg" in new.source:
        return False  # two lines are two reports (a burst of XID 13 lines is one each), never one
    if "nvml" in old.source and "nvml" in new.source:
        return False
    same_gpu = (old.gpu is not None and old.gpu == new.gpu) or (old.pci is not None and old.pci == new.pci) \
        or (old.uuid is not None and old.uuid == new.uuid)
    return same_gpu


def _merge(old: GpuEvent, new: GpuEvent) -> GpuEvent:
    """One event of two reports: the kernel log's time (the kernel's own clock) and its facts, NVML's index."""
    kernel, nvml = (old, new) if "kmsg" in old.source else (new, old)
    facts = {f.name: getattr(kernel, f.name) if getattr(kernel, f.name) is not None else getattr(nvml, f.name)
             for f in dataclasses.fields(GpuEvent) if f.name not in ("time", "source", "update", "lost")}
    return GpuEvent(**{**facts, "time": kernel.time, "source": "nvml+kmsg", "lost": False, "update": True,
                       "recovery": nvml.recovery if nvml.recovery is not None else kernel.recovery})


def driver_gpu(pci: str, root: Path = DRIVER_GPUS) -> GpuInfo | None:
    """The driver's own record of a GPU (``/proc/driver/nvidia/gpus/0000:18:00.0/information``):
    its minor number and UUID, without NVML."""
    try:
        dirs = [d for d in root.iterdir() if xids.pci_key(d.name) == pci]
        text = procfs.read_capped(dirs[0] / "information", 8192).decode(errors="replace") if dirs else ""
    except OSError:
        return None
    if not text:
        return None
    facts = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    minor = facts.get("Device Minor", "").strip()
    return GpuInfo(None, int(minor) if minor.isdigit() else None, (facts.get("GPU UUID") or "").strip() or None, None, pci)


RECORDER = Recorder()  # the node's one record: its GPUs are the daemon's whole life, not one capture's


@dataclass(frozen=True)
class GpusFound:
    """The GPUs the listener listens to, by NVML's index (none: ``Recorder.unavailable`` says why)."""

    gpus: tuple[int, ...]
    infos: tuple[GpuInfo, ...] = ()


class Poster:
    """Posts to the loop's queue at most ``POSTS_PER_S`` events a second (bursts of ``POSTS_BURST``):
    a GPU flooding the kernel log with XIDs is recorded whole, and costs the loop a bounded share."""

    def __init__(self, post: Callable[[object], None], rate: float = POSTS_PER_S, burst: int = POSTS_BURST) -> None:
        self._post = post
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._at = time.monotonic()
        self._lock = threading.Lock()
        self.suppressed = 0

    def __call__(self, message: object) -> None:
        if isinstance(message, GpuEvent):
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
                self._at = now
                if self._tokens < 1:
                    self.suppressed += 1
                    if self.suppressed in (1, 10, 100) or self.suppressed % 1000 == 0:
                        log.warning("gpu_events_suppressed", suppressed=self.suppressed,
                                    effect="recorded for incidents, not counted in the metrics")
                    return
                self._tokens -= 1
        self._post(message)


class Listener(threading.Thread):
    """NVML's XID events into ``recorder``, and each as a value to ``post`` (the daemon loop's queue:
    counted there, and the health file told); never on the loop. ``post`` gets a ``GpusFound`` once
    listening, then each ``GpuEvent``."""

    def __init__(self, recorder: Recorder, post: Callable[[object], None], nvml: Any = None, wait_ms: int = WAIT_MS) -> None:
        super().__init__(name="gpu-events", daemon=True)
        self.recorder = recorder
        self.post = post
        self.nvml = nvml
        self.wait_ms = wait_ms
        self.stopping = threading.Event()
        self.ready = threading.Event()  # listening (or given up): events from now on are seen

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        try:
            self._listen()
        except Exception as exc:  # noqa: BLE001 - a driver's surprise ends the listening, never the daemon
            self.recorder.unavailable = f"{type(exc).__name__}: {exc}"
            log.error("gpu_events_failed", error=self.recorder.unavailable)
        finally:
            self.ready.set()

    def _listen(self) -> None:
        nv: Any = self.nvml
        if nv is None:
            try:
                import pynvml

                nv = pynvml
            except ImportError:
                self._give_up("nvidia-ml-py is not installed")
                return
        try:
            nv.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - no library, no driver, no GPU: a node without GPUs is fine
            self._give_up(f"NVML is not available ({exc})")
            return
        try:
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            infos = [_info(nv, i, h) for i, h in enumerate(handles)]
            for gi in infos:
                assert gi.index is not None
                self.recorder.gpus[gi.index] = gi.minor
                self.recorder.infos[gi.index] = gi
            event_set = nv.nvmlEventSetCreate()
            for i, h in enumerate(handles):
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
                except nv.NVMLError as exc:
                    log.warning("gpu_events_not_supported", gpu=i, error=str(exc))
            log.info("gpu_events_listening", gpus=len(handles))
            self.post(GpusFound(tuple(range(len(handles))), tuple(infos)))
            self.ready.set()
            lost: set[int] = set()
            while not self.stopping.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, self.wait_ms)
                except nv.NVMLError as exc:
                    if exc.value == nv.NVML_ERROR_TIMEOUT:
                        continue
                    if exc.value == nv.NVML_ERROR_GPU_IS_LOST:
                        for i, h in enumerate(handles):  # which one: the one that no longer answers
                            if i not in lost and _is_lost(nv, h):
                                lost.add(i)
                                gi = infos[i]
                                self._seen(GpuEvent(time.time(), i, 0, gi.uuid, gi.minor, lost=True, pci=gi.pci, serial=gi.serial))
                    else:
                        log.warning("gpu_events_wait_failed", error=str(exc))
                    self.stopping.wait(1.0)  # an error repeats at once: do not spin on it
                    continue
                if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                    continue
                index = _int(_try(functools.partial(nv.nvmlDeviceGetIndex, data.device)))
                if index is None or not 0 <= index < len(infos):
                    continue
                gi = infos[index]
                self._seen(GpuEvent(time.time(), index, int(data.eventData), gi.uuid, gi.minor, pci=gi.pci, serial=gi.serial,
                                    recovery=recovery_action(nv, handles[index])))
            nv.nvmlEventSetFree(event_set)
        finally:
            _try(nv.nvmlShutdown)

    def _seen(self, event: GpuEvent) -> None:
        event = self.recorder.add(event)
        log.warning("gpu_xid", gpu=event.gpu, xid=event.xid, what=event.what, needs_reset=event.node_fault, uuid=event.uuid,
                    kind=event.kind, pid=event.pid, recovery=xids.recovery_name(event.recovery), source=event.source)
        self.post(event)

    def _give_up(self, why: str) -> None:
        self.recorder.unavailable = why
        log.info("gpu_events_unavailable", why=why)


def _info(nv: Any, index: int, handle: Any) -> GpuInfo:
    pci = _try(functools.partial(nv.nvmlDeviceGetPciInfo, handle))
    bus = _text(getattr(pci, "busId", None)) if pci is not None else None
    return GpuInfo(index, _int(_try(functools.partial(nv.nvmlDeviceGetMinorNumber, handle))),
                   _text(_try(functools.partial(nv.nvmlDeviceGetUUID, handle))),
                   _text(_try(functools.partial(nv.nvmlDeviceGetSerial, handle))), xids.pci_key(bus or ""))


def recovery_action(nv: Any, handle: Any) -> int | None:
    """The GPU's recovery action as NVML reports it (drivers of r550 on); None where it reports none."""
    field = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field is None:
        return None
    values = _try(functools.partial(nv.nvmlDeviceGetFieldValues, handle, [field]))
    try:
        v = values[0]
        return int(v.value.uiVal) if int(v.nvmlReturn) == 0 else None
    except (TypeError, IndexError, AttributeError, ValueError):
        return None


def _is_lost(nv: Any, handle: Any) -> bool:
    try:
        nv.nvmlDeviceGetUUID(handle)
    except nv.NVMLError as exc:
        return bool(exc.value == nv.NVML_ERROR_GPU_IS_LOST)
    return False


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - one fact NVML cannot give is left out, the rest is kept
        return None


def _int(v: Any) -> int | None:
    """An NVML answer as an int (None where it gave none, or nothing like one)."""
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def _text(v: Any) -> str | None:
    return v.decode(errors="replace") if isinstance(v, bytes) else (str(v) if v is not None else None)


class KernelXids:
    """The kernel log's NVRM Xid lines as ``GpuEvent`` values: recorded, and posted to the loop.

    The process a line names is looked at in /proc as the line is read (its start time and
    owner): a pid is only a process with its start time, and it may soon be gone."""

    def __init__(self, path: str, recorder: Recorder, post: Callable[[object], None]) -> None:
        self.recorder = recorder
        self.post = post
        self.reader = KernelLog(path, self._xid, on_state=self._state)

    def _state(self, why: str | None) -> None:
        self.recorder.kernel_log = why

    def start(self) -> None:
        self.reader.start()

    def stop(self) -> None:
        self.reader.stop()

    def _xid(self, line: xids.XidLine, when: float) -> None:
        gi = self.recorder.info(pci=line.pci)
        start = procfs.start_time(line.pid) if line.pid else None
        event = GpuEvent(when, gi.index if gi else None, line.xid, gi.uuid if gi else None, gi.minor if gi else None,
                         pci=line.pci, serial=gi.serial if gi else None, pid=line.pid, process=line.name,
                         start_time=start, uid=procfs.uid(line.pid) if start is not None and line.pid else None,
                         detail=line.detail or None, cause=line.cause, recovery=line.recovery, source="kmsg")
        event = self.recorder.add(event)
        log.warning("gpu_xid", gpu=event.gpu, pci=event.pci, xid=event.xid, what=event.what, kind=event.kind,
                    needs_reset=event.node_fault, pid=event.pid, process=event.process, cause=event.cause,
                    source=event.source)
        self.post(event)

    @property
    def unavailable(self) -> str | None:
        return self.reader.unavailable


# -- into an incident ------------------------------------------------------------

LOOKBACK = 3600.0  # seconds before a process stopped whose GPU events still belong in its incident


def gpus_of(pid: int, recorder: Recorder, pdir: Path | None = None) -> set[int]:
    """The GPUs (NVML indices) a process uses: NVML's own answer in its capture where there is one,
    else the /dev/nvidiaN files it holds open (CUDA keeps them open for the life of the context)."""
    found: set[int] = set()
    if pdir is not None:
        try:
            nvml = json.loads((pdir / "nvml.json").read_text())
            found |= {g for g in nvml.get("process_gpus") or [] if isinstance(g, int) and not isinstance(g, bool)}
        except (OSError, ValueError, AttributeError):
            pass
    for path in procfs.gpu_device_files(pid):
        m = DEVICE.match(path)
        if m:
            index = recorder.index_of_minor(int(m.group(1)))
            if index is not None:
                found.add(index)
    return found


def attach(incident_dir: Path, processes: Iterable[ProcessId | int], stopped: float | None,
           recorder: Recorder = RECORDER) -> list[str]:
    """``PID/gpu-events.json`` for each captured process that ran on a GPU with events, or that an
    event names; the files written. Each holds the process's GPUs (index, UUID, serial, PCI
    address), when it stopped, and the events, each with whether it named this very process."""
    written: list[str] = []
    events = recorder.events()
    if not events:
        return written
    since = (stopped or time.time()) - LOOKBACK
    for proc in processes:
        pid = proc if isinstance(proc, int) else proc.pid
        start = None if isinstance(proc, int) else proc.start_time
        pdir = incident_dir / str(pid)
        gpus = gpus_of(pid, recorder, pdir)
        infos = [recorder.infos.get(g) or GpuInfo(g, recorder.gpus.get(g)) for g in sorted(gpus)]
        pcis = {gi.pci for gi in infos if gi.pci}
        mine = [e for e in events if e.time >= since and (e.gpu in gpus or (e.gpu is None and e.pci in pcis)
                                                          or e.pid == pid)]
        if not mine or not pdir.is_dir():
            continue
        data = {"pid": pid, "start_time": start, "gpus": sorted(gpus), "gpu_info": [asdict(gi) for gi in infos],
                "stopped": stopped, "kernel_log": recorder.kernel_log, "nvml": recorder.unavailable,
                "events": [{**e.to_json(), "own": _own(e, pid, start)} for e in mine]}
        try:
            (pdir / "gpu-events.json").write_text(json.dumps(data, indent=1))
            written.append(f"{pid}/gpu-events.json")
        except OSError as exc:
            log.error("gpu_events_write_failed", dir=str(pdir), error=str(exc))
    return written


def _own(event: GpuEvent, pid: int, start: int | None) -> bool | None:
    """Whether ``event`` named this very process; None where it named none."""
    if event.pid is None:
        return None
    return event.pid == pid and (start is None or event.start_time is None or event.start_time == start)
