"""When each process sampled by its stack last had a thread run, to the second: one thread's cheap look.

A stack sample every ``stack_interval`` (5 s) says the stack has held since that sample, not
since the process stopped: a freeze was noticed up to an interval late. Every second this thread
reads, for each process the sampler has been asked about lately, the CPU time of each of its
threads (``host.activity.ran``: one ``schedstat`` per thread, no ptrace, no pause) and keeps when
that digest last changed. A stack read later, with the digest still the same, has held since
then: none of its threads ran in between (``Sample.since``), so a freeze counts from within a
second of it.

Nothing here decides anything: the sampler asks ``settled(process, digest)``. Processes not asked
about for ``FORGET_AFTER`` seconds, and processes that are gone, are dropped; at most
``MAX_PROCESSES`` are followed.
"""

from __future__ import annotations

import threading
import time

import structlog

from ..host import activity
from ..model import ProcessId

log = structlog.get_logger("hangwatchd.daemon")

EVERY = 1.0  # seconds between looks at one process
FORGET_AFTER = 60.0  # seconds a process is followed after the sampler last asked about it
MAX_PROCESSES = 10_000  # as many as the daemon watches at most


class Quiet:
    def __init__(self, every: float = EVERY) -> None:
        self.every = every
        # process -> (its digest at the last look, when that digest was first seen, when last asked about).
        # Written by this thread; ``follow`` adds entries from the sampler's workers (one key each).
        self._seen: dict[ProcessId, tuple[int | None, float, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="quiet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def follow(self, process: ProcessId, digest: int | None, now: float) -> None:
        """The sampler read ``digest`` of ``process``, finishing its read at ``now``: follow it from here on."""
        old = self._seen.get(process)
        if old is not None and old[0] == digest:
            self._seen[process] = (digest, old[1], now)
        elif old is not None or len(self._seen) < MAX_PROCESSES:
            self._seen[process] = (digest, now, now)

    def settled(self, process: ProcessId, digest: int | None) -> float | None:
        """Since when ``process``'s threads have all stood still, where its digest is still ``digest``
        (monotonic); None when unknown (not followed, another digest, or no digest)."""
        seen = self._seen.get(process)
        if digest is None or seen is None or seen[0] != digest:
            return None
        return seen[1]

    def look(self, now: float) -> None:
        """One pass over every followed process."""
        for process, (digest, _since, asked) in list(self._seen.items()):
            if now - asked > FORGET_AFTER:
                self._seen.pop(process, None)
                continue
            d = activity.ran(process.pid)
            if d is None:
                self._seen.pop(process, None)  # gone (or nothing can be told): the next sample starts over
            elif d != digest:
                # Read just now: whatever ran, ran before this moment; nothing did after it while ``d`` holds.
                self._seen[process] = (d, time.monotonic(), asked)
        self.passes += 1

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, self.every - (time.monotonic() % self.every))):
            try:
                self.look(time.monotonic())
            except Exception as exc:  # a bug here costs the backdating, never the sampling
                log.exception("quiet_look_failed", error=f"{type(exc).__name__}: {exc}")
