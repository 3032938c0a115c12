"""The node's GPU faults as they happen: NVML's XID events, recorded while the daemon runs.

An XID is the driver's report of a GPU error (79: the GPU fell off the bus; 48:
a double-bit ECC error; 13: a kernel's exception). NVML only tells a listener
that was registered *before* the error, so the daemon listens from its start,
on a thread of its own: ``nvmlEventSetWait`` blocks (with a timeout) in the
driver, and whatever the driver does there never touches the loop. Events are
kept in a bounded list (the newest win) with their time and GPU, counted in
``hangwatchd_gpu_xid_errors_total``, written beside the processes of an
incident that ran on that GPU (``gpu-events.json``), and read by
``hangwatchd health``: an XID that needs a reset, or a lost GPU, is the node's
fault, never a job's.

The seam is NVML's own API: the listener takes the ``pynvml`` module (or any
object with its functions), so a test feeds it real ``c_nvmlEventData_t``
records without a GPU.
"""

from __future__ import annotations

import collections
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from . import procfs

log = structlog.get_logger("hangwatchd.gpu")

# NVIDIA's XID catalogue, the critical ones: what each means and whether the GPU needs a reset (or is gone)
# before it can be trusted again. Those are the node's fault; the others are usually a job's own error.
XIDS: dict[int, tuple[str, bool]] = {
    13: ("graphics engine exception", False),
    31: ("GPU memory page fault", False),
    43: ("GPU stopped processing", False),
    48: ("double-bit ECC error", True),
    63: ("ECC page retirement or row remapping recorded", False),
    64: ("ECC page retirement or row remapping failed", True),
    74: ("NVLink error", True),
    79: ("fell off the bus", True),
    92: ("high single-bit ECC error rate", False),
    94: ("contained ECC error", True),
    95: ("uncontained ECC error", True),
    109: ("context switch timeout", False),
    119: ("GSP RPC timeout", True),
    120: ("GSP error", True),
}
MAX_EVENTS = 1024  # the newest kept: a flapping GPU cannot grow the daemon
WAIT_MS = 1000  # how long one wait in the driver lasts before the listener looks at its stop flag
DEVICE = re.compile(r"/dev/nvidia(\d+)$")


def describe(xid: int) -> str:
    return XIDS.get(xid, ("an XID error", False))[0]


def needs_reset(xid: int) -> bool:
    return XIDS.get(xid, ("", False))[1]


@dataclass(frozen=True)
class GpuEvent:
    """One XID on one GPU, at a wall-clock time (NVML gives none in its record: the time it was received)."""

    time: float
    gpu: int  # NVML's index
    xid: int
    uuid: str | None = None
    minor: int | None = None  # /dev/nvidiaMINOR, how a process's open files name the GPU
    lost: bool = False  # the GPU stopped answering NVML at all

    @property
    def what(self) -> str:
        return "GPU is lost (stopped answering NVML)" if self.lost else describe(self.xid)

    @property
    def node_fault(self) -> bool:
        return self.lost or needs_reset(self.xid)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "what": self.what, "needs_reset": self.node_fault}


class Recorder:
    """The events seen since the daemon started, bounded; read from any thread."""

    def __init__(self, limit: int = MAX_EVENTS) -> None:
        self._events: collections.deque[GpuEvent] = collections.deque(maxlen=limit)
        self._lock = threading.Lock()
        self.gpus: dict[int, int | None] = {}  # index -> minor number, once the listener found them
        self.unavailable: str | None = None  # why nothing is listened to (no driver, no GPU)

    def add(self, event: GpuEvent) -> None:
        with self._lock:
            self._events.append(event)

    def events(self) -> list[GpuEvent]:
        with self._lock:
            return list(self._events)

    def index_of_minor(self, minor: int) -> int | None:
        return next((i for i, m in self.gpus.items() if m == minor), None)


RECORDER = Recorder()  # the node's one record: its GPUs are the daemon's whole life, not one capture's


@dataclass(frozen=True)
class GpusFound:
    """The GPUs the listener listens to, by NVML's index (none: ``Recorder.unavailable`` says why)."""

    gpus: tuple[int, ...]


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
            uuids = [_text(_try(functools.partial(nv.nvmlDeviceGetUUID, h))) for h in handles]
            for i, h in enumerate(handles):
                self.recorder.gpus[i] = _int(_try(functools.partial(nv.nvmlDeviceGetMinorNumber, h)))
            event_set = nv.nvmlEventSetCreate()
            for i, h in enumerate(handles):
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
                except nv.NVMLError as exc:
                    log.warning("gpu_events_not_supported", gpu=i, error=str(exc))
            log.info("gpu_events_listening", gpus=len(handles))
            self.post(GpusFound(tuple(range(len(handles)))))
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
                                self._seen(GpuEvent(time.time(), i, 0, uuids[i], self.recorder.gpus.get(i), lost=True))
                    else:
                        log.warning("gpu_events_wait_failed", error=str(exc))
                    self.stopping.wait(1.0)  # an error repeats at once: do not spin on it
                    continue
                if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                    continue
                index = _int(_try(functools.partial(nv.nvmlDeviceGetIndex, data.device)))
                if index is None:
                    continue
                self._seen(GpuEvent(time.time(), index, int(data.eventData), uuids[index] if index < len(uuids) else None,
                                    self.recorder.gpus.get(index)))
            nv.nvmlEventSetFree(event_set)
        finally:
            _try(nv.nvmlShutdown)

    def _seen(self, event: GpuEvent) -> None:
        self.recorder.add(event)
        log.warning("gpu_xid", gpu=event.gpu, xid=event.xid, what=event.what, needs_reset=event.node_fault, uuid=event.uuid)
        self.post(event)

    def _give_up(self, why: str) -> None:
        self.recorder.unavailable = why
        log.info("gpu_events_unavailable", why=why)


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
    return v.decode() if isinstance(v, bytes) else (str(v) if v is not None else None)


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


def attach(incident_dir: Path, pids: Iterable[int], stopped: float | None, recorder: Recorder = RECORDER) -> list[str]:
    """``PID/gpu-events.json`` for each captured process that ran on a GPU with events; the files written."""
    written: list[str] = []
    events = recorder.events()
    if not events:
        return written
    since = (stopped or time.time()) - LOOKBACK
    for pid in pids:
        pdir = incident_dir / str(pid)
        gpus = gpus_of(pid, recorder, pdir)
        mine = [e for e in events if e.gpu in gpus and e.time >= since]
        if not mine or not pdir.is_dir():
            continue
        data = {"pid": pid, "gpus": sorted(gpus), "stopped": stopped, "events": [e.to_json() for e in mine]}
        try:
            (pdir / "gpu-events.json").write_text(json.dumps(data, indent=1))
            written.append(f"{pid}/gpu-events.json")
        except OSError as exc:
            log.error("gpu_events_write_failed", dir=str(pdir), error=str(exc))
    return written
