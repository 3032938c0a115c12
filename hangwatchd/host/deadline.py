"""One absolute deadline, made once and handed down unchanged (trio's ``CancelScope.deadline``).

A capture's deadline is set when its hang is declared; every step, subprocess,
probe and compression under it is cut at it (``cut``: its own timeout or the
deadline, whichever comes first), never given a fresh budget of seconds that
would start counting again further down. It also knows when it was made
(``made``: a capture's, when its hang was declared), so that what describes the
node as of that moment (the scan of every process's descriptors) can be shared
by the captures declared together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Deadline:
    at: float  # time.monotonic()
    made: float | None = field(default=None, compare=False)  # time.monotonic() when it was made (``after``)

    @classmethod
    def after(cls, seconds: float, now: float | None = None) -> Deadline:
        now = time.monotonic() if now is None else now
        return cls(now + seconds, now)

    def left(self, now: float | None = None) -> float:
        """Seconds until it passes (0 once it has)."""
        return max(0.0, self.at - (time.monotonic() if now is None else now))

    def passed(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.at

    def cut(self, seconds: float, now: float | None = None) -> Deadline:
        """``seconds`` from now, or this deadline where that comes first: a step's own timeout under it."""
        return Deadline(min(self.at, (time.monotonic() if now is None else now) + seconds), self.made)

    def sooner(self, seconds: float) -> Deadline:
        """This deadline, ``seconds`` earlier: what the gentle steps get when the GPU dump's time is held back."""
        return Deadline(self.at - seconds, self.made)
