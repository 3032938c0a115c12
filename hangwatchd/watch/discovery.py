"""Finding GPU processes nobody registered, within seconds of their opening the GPU, off the loop.

The rescan that ran every 30 s found new GPU processes 27 s after they started
on an H200: a process that hung in its first half minute was invisible that
long. Reading every process's fds every second would cost too much on a node
of hundreds of processes, so this thread looks, every ``interval``:
- at the fds of *young* processes only (started less than ``young`` seconds
  ago), every second at first and every ``MAX_GAP`` seconds at most as they age:
  a process opens the GPU when it starts its CUDA work, most often in its
  first minute; one listing of /proc tells which pids are new;
- at NVML's running-process lists, where there is NVML: any process with a
  CUDA context, however old.
Older processes that open the GPU late, without NVML, are found by the full
rescan (``rescan_interval``). What a look found goes to the loop's queue as one
``GpuPidsFound`` value; the loop admits it there, on its own thread, which
owns the watchlist.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from ..host import procfs

log = structlog.get_logger("hangwatchd.discovery")

CLK_TCK = os.sysconf("SC_CLK_TCK")
YOUNG = 60.0  # seconds after its start a process is looked at
MAX_GAP = 3.0  # seconds at most between two looks at a young process: found within MAX_GAP + interval


@dataclass(frozen=True)
class GpuPidsFound:
    """Processes that opened the GPU since the last look (not yet reported), for the loop to admit."""

    pids: tuple[int, ...]


def holds_device(pid: int, prefix: str) -> bool:
    """Whether ``pid`` holds a file under ``prefix`` open (the control device alone does not count).

    Plain strings and the first match: this runs for every young process every few seconds."""
    base = f"{procfs.PROC}/{pid}/fd/"
    try:
        fds = os.listdir(base)
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(base + fd)
        except OSError:
            continue
        if target.startswith(prefix) and target != "/dev/nvidiactl":
            return True
    return False


def holders(prefix: str) -> list[int]:
    """Every process holding a file under ``prefix`` open: the full scan, every fd of every process."""
    try:
        pids = [int(e) for e in os.listdir(procfs.PROC) if e.isdigit()]
    except OSError:
        return []
    return [p for p in pids if holds_device(p, prefix)]


class Discovery:
    def __init__(self, prefix: str = "/dev/nvidia", interval: float = 1.0,
                 post: Callable[[object], None] | None = None, young: float = YOUNG, use_nvml: bool = True) -> None:
        self.prefix = prefix
        self.interval = interval
        self.young = young
        self.post = post  # the loop's queue
        self.use_nvml = use_nvml
        self.born: dict[int, float] = {}  # pid -> when it started (seconds since boot)
        self.next_look: dict[int, float] = {}  # pid -> when to look at its fds again (seconds since boot)
        self.reported: set[int] = set()  # pids handed to the loop already (while they live)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None  # the pynvml module once initialised; False when there is none
        self._nvml_latest: set[int] = set()  # the last answer of NVML's process lists (its own thread)
        self.seconds = 0.0  # CPU seconds its threads spent looking (for the bench)

    # -- the thread --------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="discovery", daemon=True)
        self._thread.start()
        if self.use_nvml:
            # Apart from the /proc scan: an NVML call on a sick GPU can hang, and cannot be cancelled
            # in-process; then only this thread waits, and the scan goes on with the last list.
            threading.Thread(target=self._run_nvml, name="discovery-nvml", daemon=True).start()

    def _run_nvml(self) -> None:
        while not self._stop.is_set():
            started = time.thread_time()
            pids = set(self._nvml_query())
            with self._lock:
                self._nvml_latest = pids
                self.seconds += time.thread_time() - started
            if self._nvml is False:
                return  # no NVML here: nothing to ask again
            self._stop.wait(self.interval)
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a library that may already be gone
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(0 if not self.born else self.interval):
            try:
                new = self.scan()
            except Exception as exc:  # noqa: BLE001 - a failed scan must not end discovery
                log.error("discovery_failed", error=f"{type(exc).__name__}: {exc}")
                continue
            if self.post is not None:  # every scan, found nothing or not: the loop counts the passes
                self.post(GpuPidsFound(tuple(new)))

    # -- one scan ----------------------------------------------------------

    def scan(self, now: float | None = None) -> list[int]:
        """Look once; return the GPU processes not reported before (the thread posts them to the loop).

        A process's age comes from its start time (read once, when its pid is new), so one
        started just before this thread is still young."""
        started = time.thread_time()
        now = time.clock_gettime(time.CLOCK_BOOTTIME) if now is None else now
        try:
            pids = {int(e) for e in os.listdir(procfs.PROC) if e.isdigit()}
        except OSError:
            return []
        for pid in [p for p in self.born if p not in pids]:
            del self.born[pid]
            self.next_look.pop(pid, None)
        self.reported &= pids
        for pid in pids:
            if pid not in self.born:
                ticks = procfs.start_time(pid)
                self.born[pid] = ticks / CLK_TCK if ticks is not None else now
        me = os.getpid()
        young = [p for p in pids if now - self.born[p] <= self.young and p not in self.reported and p != me
                 and self.next_look.get(p, 0.0) <= now]
        for p in young:  # the older, the less often: every second at first, every MAX_GAP at most
            self.next_look[p] = now + min(MAX_GAP, max(self.interval, (now - self.born[p]) / 4)) - self.interval / 2
        new = [p for p in young if holds_device(p, self.prefix)]
        with self._lock:
            listed = self._nvml_latest
        new += [p for p in listed if p in pids and p not in self.reported and p != me and p not in new]
        if new:
            self.reported.update(new)
            log.info("gpu_processes_found", pids=new)
        with self._lock:
            self.seconds += time.thread_time() - started
        return new

    def _nvml_query(self) -> Iterable[int]:
        """Every process with a CUDA context on any GPU, where NVML is there; nothing where it is not."""
        if not self.use_nvml or self._nvml is False:
            return ()
        if self._nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:  # noqa: BLE001 - no driver, no library, no GPU: the /proc scan alone
                self._nvml = False
                return ()
        nv = self._nvml
        out: set[int] = set()
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                for query in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
                    out.update(p.pid for p in query(handle))
        except Exception as exc:  # noqa: BLE001 - a GPU fallen off the bus: the /proc scan goes on
            log.warning("nvml_process_list_failed", error=f"{type(exc).__name__}: {exc}")
        return out
