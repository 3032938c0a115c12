"""Per-user bounds on the work one user's registrations make the root daemon do.

Any local user may register processes, and each one registered costs root
ptrace reads (py-spy) and bookkeeping. One user must not be able to take all
of it: at most ``max_registrations`` watched processes per uid, and at most
``samples_per_second`` py-spy samples per uid (a token bucket, so a job's
ranks may sample together in a burst). Root's own processes are not limited:
root can do all of this without us.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class UserLimits:
    max_registrations: int
    samples_per_second: float
    burst_seconds: float = 2.0  # a bucket holds this many seconds' worth of samples
    _buckets: dict[int, tuple[float, float]] = field(default_factory=dict)  # uid -> (tokens, at)
    _noted: set[tuple[str, int]] = field(default_factory=set)

    def over_registrations(self, uid: int, watched_uids: Iterable[int]) -> str | None:
        """Why a new registration of ``uid`` is refused (None: admit it), given the uids watched now."""
        if uid == 0:
            return None
        n = sum(1 for u in watched_uids if u == uid)
        if n >= self.max_registrations:
            return f"uid {uid} already has {n} watched processes (max_registrations_per_uid = {self.max_registrations})"
        return None

    def sample_wait(self, uid: int, now: float) -> float:
        """0.0 when ``uid`` may take a py-spy sample now (and spends it); else seconds until it may."""
        if uid == 0:
            return 0.0
        cap = max(1.0, self.samples_per_second * self.burst_seconds)
        tokens, at = self._buckets.get(uid, (cap, now))
        tokens = min(cap, tokens + (now - at) * self.samples_per_second)
        if tokens >= 1.0:
            self._buckets[uid] = (tokens - 1.0, now)
            return 0.0
        self._buckets[uid] = (tokens, now)
        return (1.0 - tokens) / self.samples_per_second

    def first(self, what: str, uid: int) -> bool:
        """True the first time ``what`` happens to ``uid`` since it was last cleared: log it once."""
        if (what, uid) in self._noted:
            return False
        self._noted.add((what, uid))
        return True

    def clear(self, what: str, uid: int) -> None:
        self._noted.discard((what, uid))
