"""PyTorch's flight recorder asked as a rank starts, so that its dump at a hang comes at once.

PyTorch 2.11 turns each trace entry's Python frames into names when it dumps,
and looks up ``torch._inductor`` for that: a process in eager mode imports
torch._inductor, torch._dynamo and sympy the first time it dumps a trace with
entries. On an H200 that put the first such trace 3.4 to 7 s after the
request, where later ones, of 1,000 entries as of 10, take a few milliseconds
(docs/speed.md). Paid at the hang, it was the slowest part of a capture; and
PyTorch's own dump on timeout pays it too, as the job dies.

So this daemon asks each watched rank's flight recorder as soon as the rank
holds its pipe (its NCCL process group exists), waits for the trace and reads
it: once a trace has an entry with Python frames, PyTorch has paid its import,
during start-up, on its own dump thread, and the rank is done. A trace with no
entry yet (asked before the first collective) cost PyTorch nothing and taught
it nothing: the rank is asked again later, less often each time. A process
that has torch._inductor already (any torch.compile user, vLLM and SGLang
among them) pays a few milliseconds. The trace is the user's own file in the
workload's chosen place, overwritten by the next dump.

One thread looks for pipes (every second at first, every ``MAX_GAP`` at most,
for ``WINDOW`` seconds after a process is watched) and ``WORKERS`` threads
wait for the traces; the loop hands processes over (``add``) and never waits.
Each rank's outcome (warmed, or why not) comes back on the loop's queue as a
``WarmupDone`` value, an exception included.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ..analyze import flight
from ..capture.base import StepFailed
from ..capture.flight_recorder import NoPipe, Pipe, find_pipe, request_trace
from ..host import procfs, untrusted
from ..model import Registration

log = structlog.get_logger("hangwatchd.daemon")

WINDOW = 1800.0  # seconds after it is watched that a process is looked at (and asked again while its traces are empty)
MAX_GAP = 60.0  # seconds at most between two looks at one process
MAX_PENDING = 10_000  # processes waiting: the daemon's own bound on processes watched
WORKERS = 4  # traces waited for at once
TRACE_WAIT = 20.0  # seconds PyTorch may take to write the trace (its import took up to 7 s on an H200)
MAX_TRACE = 16 << 20  # bytes of a trace read to see whether it has entries; a bigger one has thousands


@dataclass(frozen=True)
class WarmupDone:
    """One rank's flight recorder asked as it started: "warmed", or why it was not."""

    registration: Registration
    outcome: str
    seconds_after_watched: float


class Warmup:
    def __init__(self, post: Callable[[object], None], interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.post = post  # the loop's queue
        self.interval = interval
        self.clock = clock
        self._pending: dict[int, tuple[Registration, float, float]] = {}  # pid -> (process, added, next look)
        self._asking: set[int] = set()  # pids whose trace a worker waits for
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="fr-warmup")

    def add(self, reg: Registration) -> None:
        """Look for this process's pipe from now on (the loop calls this; it never blocks)."""
        now = self.clock()
        with self._lock:
            if len(self._pending) < MAX_PENDING:
                self._pending[reg.process.pid] = (reg, now, now)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fr-warmup", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.look()
            except Exception as exc:  # noqa: BLE001 - a failed look must not end the thread
                log.error("flight_recorder_warmup_failed", error=f"{type(exc).__name__}: {exc}")

    def _later(self, pid: int, now: float) -> None:
        """Look at it again after a gap that grows with its age."""
        with self._lock:
            if pid in self._pending:
                reg, added, _ = self._pending[pid]
                self._pending[pid] = (reg, added, now + min(MAX_GAP, max(self.interval, (now - added) / 4)))

    def _forget(self, pid: int) -> None:
        with self._lock:
            self._pending.pop(pid, None)

    def look(self) -> None:
        """One pass over the processes due: hand those that hold their pipe to a worker."""
        now = self.clock()
        with self._lock:
            due = [(pid, reg, added) for pid, (reg, added, at) in self._pending.items()
                   if at <= now and pid not in self._asking]
        for pid, reg, added in due:
            if not procfs.alive(reg.process) or now - added > WINDOW:
                self._forget(pid)
                continue
            try:
                pipe = find_pipe(reg)
            except NoPipe:
                self._later(pid, now)
                continue
            except StepFailed:  # not started by hangwatchd run, or no single uid: nothing to ask
                self._forget(pid)
                continue
            with self._lock:
                self._asking.add(pid)
            self._pool.submit(self._ask, reg, pipe, added)

    def _ask(self, reg: Registration, pipe: Pipe, added: float) -> None:
        pid = reg.process.pid
        outcome = "failed: the warm-up stopped before it finished"
        try:
            outcome = ask(reg, pipe, self._stop.is_set)
        except Exception as exc:  # noqa: BLE001 - one rank's failure must not end the worker
            outcome = f"failed: {type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._asking.discard(pid)
            now = self.clock()
            if outcome == "empty":  # asked before its first collective: again later
                self._later(pid, now)
            else:
                self._forget(pid)
                self.post(WarmupDone(reg, outcome, now - added))


def ask(reg: Registration, pipe: Pipe, stopping: Callable[[], bool] = lambda: False) -> str:
    """Ask once and read the trace: 'warmed' when it has an entry with Python frames, 'empty'
    when it has none yet, else why nothing came (the wait ends early when ``stopping()``)."""
    def finished() -> bool:
        return stopping() or not procfs.alive(reg.process)

    try:
        with request_trace(reg.process.pid, pipe, TRACE_WAIT, finished) as (watch, found):
            if found is None:
                return f"no trace within {TRACE_WAIT:g} s (or the process ended, or the daemon is stopping)"
            try:
                fd = watch.open(found, pipe.owner, MAX_TRACE)
                try:
                    raw = untrusted.read_fd(fd, found, MAX_TRACE, 5.0)
                finally:
                    os.close(fd)
            except untrusted.Refused as exc:
                # Bigger than we read: thousands of entries, named (and imported for) already.
                return "warmed" if exc.reason == "too_big" else f"refusing to read the trace: {exc}"
    except StepFailed as exc:
        return str(exc)
    record, why = flight.parse(raw)
    if record is None:
        return f"the trace is {why}"
    return "warmed" if any(e.frames for e in record.entries) else "empty"
