"""Per-user bounds on the work one user's registrations make the root daemon do.

Any local user may register processes, and each one registered costs root
ptrace reads (py-spy) and bookkeeping. One user must not be able to take all
of it: at most ``max_registrations`` watched processes per uid, and at most
``samples_per_second`` py-spy samples per uid (a token bucket, so a job's
ranks may sample together in a burst). Root's own processes are not limited:
root can do all of this without us.

``Budgets`` bounds what a user's hangs and files make the daemon do once they
are watched: captures in flight and seconds in capture, dumps ingested,
incidents filed and log lines written, each per uid (see its docstring).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class UserLimits:
    max_registrations: int
    samples_per_second: float
    burst_seconds: float = 2.0  # a bucket holds this many seconds' worth of samples
    budgets: Budgets = field(default_factory=lambda: Budgets())  # what a watched user's hangs and files may cost
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


@dataclass
class _Bucket:
    """A token bucket: ``rate`` tokens a second, holding at most ``cap``."""

    rate: float
    cap: float
    tokens: float
    at: float

    def take(self, now: float, n: float = 1.0) -> bool:
        self.tokens = min(self.cap, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def charge(self, now: float, n: float) -> None:
        """Spend ``n`` after the fact (time a capture took): the bucket may go below zero."""
        self.tokens = min(self.cap, self.tokens + (now - self.at) * self.rate) - n
        self.at = now

    def left(self, now: float) -> float:
        return min(self.cap, self.tokens + (now - self.at) * self.rate)


# What a user's files and processes can make the daemon do, each with its own budget: rates are
# per minute, as the config keys say ("dump", "incident", "log"); "capture_seconds" refills over an hour.
UNKNOWN = -1  # the budget key of what no known user made


@dataclass
class Budgets:
    """Per-user budgets for everything a user can make the root daemon do, so that one
    user's flood never delays another's capture: captures in flight, seconds in capture,
    dumps ingested, incidents filed, log lines (and, in the spool, bytes kept).

    Root (uid 0) is never limited: root can do all of this without us. A uid over a
    budget is told so once (``first``) until it is under again; the daemon counts the rest.
    Thread-safe: the loop asks, capture workers report back."""

    captures_in_flight: int = 1
    capture_seconds_per_hour: float = 600.0
    per_minute: dict[str, float] = field(default_factory=lambda: {"dump": 6.0, "incident": 6.0, "log": 60.0})
    _flight: dict[int, int] = field(default_factory=dict)
    _buckets: dict[tuple[str, int], _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    MAX_UIDS = 4096  # table bound: buckets of uids idle this long are full again anyway

    def _bucket(self, what: str, uid: int, now: float) -> _Bucket:
        key = (what, uid)
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self.MAX_UIDS:
                self._buckets = {k: v for k, v in self._buckets.items() if v.left(now) < v.cap}
            if what == "capture_seconds":
                b = _Bucket(self.capture_seconds_per_hour / 3600.0, self.capture_seconds_per_hour,
                            self.capture_seconds_per_hour, now)
            else:
                rate = self.per_minute[what]
                b = _Bucket(rate / 60.0, max(1.0, rate), max(1.0, rate), now)
            self._buckets[key] = b
        return b

    def allow(self, what: str, uid: int | None, now: float) -> bool:
        """Spend one of ``what`` ("dump", "incident", "log") for ``uid`` if its budget has one.
        Root is not held to one; what has no known owner (a file gone before it was opened)
        shares one budget, as if one user (UNKNOWN) had made it all."""
        if uid == 0:
            return True
        with self._lock:
            return self._bucket(what, UNKNOWN if uid is None else uid, now).take(now)

    def start_capture(self, uid: int | None, now: float) -> str | None:
        """Take a capture slot for ``uid``; None when taken, else why it must wait."""
        if not uid:
            return None
        with self._lock:
            flying = self._flight.get(uid, 0)
            if flying >= self.captures_in_flight:
                return (f"uid {uid} already has {flying} capture(s) in flight "
                        f"(captures_per_uid = {self.captures_in_flight})")
            left = self._bucket("capture_seconds", uid, now).left(now)
            if left <= 0:
                return (f"uid {uid} used its {self.capture_seconds_per_hour:g} s of capture this hour "
                        "(capture_seconds_per_uid)")
            self._flight[uid] = flying + 1
            return None

    def end_capture(self, uid: int | None, seconds: float, now: float) -> None:
        """A capture of ``uid``'s took ``seconds``: its slot back, its time charged."""
        if not uid:
            return
        with self._lock:
            n = self._flight.get(uid, 0) - 1
            if n > 0:
                self._flight[uid] = n
            else:
                self._flight.pop(uid, None)
            self._bucket("capture_seconds", uid, now).charge(now, seconds)

    def in_flight(self, uid: int) -> int:
        with self._lock:
            return self._flight.get(uid, 0)
