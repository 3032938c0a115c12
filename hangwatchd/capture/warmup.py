"""PyTorch's flight recorder asked once as a rank starts, so that its dump at a hang comes at once.

PyTorch 2.11 turns the trace's Python frames into names on every dump, and
looks up ``torch._inductor`` for that: a process in eager mode imports
torch._inductor, torch._dynamo and sympy on its first dump. On an H200 that put
the first trace 3.4 to 6.5 s after the request, where later ones take
milliseconds (docs/speed.md). Paid at the hang, it is the slowest part of a
capture, and PyTorch's own dump on timeout pays it too, as the job dies.

So this thread asks each watched rank's flight recorder once, as soon as the
rank holds its pipe (its NCCL process group exists), and lets PyTorch pay the
import during start-up, on PyTorch's own dump thread. The trace it writes is
the user's own file in the workload's chosen place, overwritten by the next
dump; nothing reads it. A process that already has torch._inductor (any
torch.compile user, vLLM and SGLang among them) pays a few milliseconds.

A rank's pipe is looked for every second at first and every ``MAX_GAP`` at
most, for ``WINDOW`` seconds after it is watched; the loop hands processes
over (``add``) and never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from ..host import procfs
from ..model import Registration
from .base import StepFailed, poke_held_fifo
from .flight_recorder import NoPipe, find_pipe

log = structlog.get_logger("hangwatchd.capture")

WINDOW = 1800.0  # seconds after it is watched that a process is looked at for its pipe
MAX_GAP = 10.0  # seconds at most between two looks at one process
MAX_PENDING = 10_000  # processes waiting for their pipe: the daemon's own bound on processes watched


class Warmup:
    def __init__(self, interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._pending: dict[int, tuple[Registration, float, float]] = {}  # pid -> (process, added, next look)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.look()
            except Exception as exc:  # noqa: BLE001 - a failed look must not end the thread
                log.error("flight_recorder_warmup_failed", error=f"{type(exc).__name__}: {exc}")

    def look(self) -> list[int]:
        """One pass over the processes due: ask those that hold their pipe now; return their pids."""
        now = self.clock()
        with self._lock:
            due = [(pid, reg, added) for pid, (reg, added, at) in self._pending.items() if at <= now]
        asked, done = [], []
        for pid, reg, added in due:
            if not procfs.alive(reg.process) or now - added > WINDOW:
                done.append(pid)
                continue
            try:
                pipe = find_pipe(reg)
            except NoPipe:
                gap = min(MAX_GAP, max(self.interval, (now - added) / 4))  # the older, the less often
                with self._lock:
                    if pid in self._pending:
                        self._pending[pid] = (reg, added, now + gap)
                continue
            except StepFailed:  # not started by hangwatchd run, or no single uid: nothing to ask
                done.append(pid)
                continue
            done.append(pid)
            try:
                poke_held_fifo(pid, pipe.fifo, b"1", pipe.owner)
            except StepFailed as exc:
                log.warning("flight_recorder_warmup_refused", pid=pid, error=str(exc))
                continue
            asked.append(pid)
            log.info("flight_recorder_warmed", pid=pid, job=reg.job, rank=reg.rank, seconds_after_watched=round(now - added, 2))
        with self._lock:
            for pid in done:
                self._pending.pop(pid, None)
        return asked
