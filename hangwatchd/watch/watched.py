"""The daemon's running record of each watched process, and the one place its life changes.

A ``Registration`` is the frozen claim a workload made; a ``Watched`` is what
the daemon has learned of it since (its beats, its stack samples). Its life -
its state and what hangs on the state (the suspicion, the timers, the
progress mark taken when it was declared hung, the capture's retry, its
incident) - changes only through ``Watchlist.change``: counted, logged and
announced there, and refused anywhere else (``Watched.__setattr__``). A
process that goes is dropped from the ``Watchlist`` with everything it held,
at once (``Watchlist.forget``). The loop thread is the only caller.
"""

from __future__ import annotations

import heapq
import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from ..host import untrusted
from ..metrics import Metrics
from ..model import ProcessId, Registration, State, Suspicion
from ..workload import beat_segment, exits
from ..workload.beat_segment import Reading
from ..workload.registration_file import MAX_FILE, READ_DEADLINE
from .stack_history import StackHistory

log = structlog.get_logger("hangwatchd.daemon")

STATUS_MAX = 4096

# A process's life: written by Watchlist.change alone (Watched.__setattr__ refuses anyone else).
OWNED: Final = frozenset({"state", "suspicion", "confirm_by", "next_check", "next_sample", "mark", "retry_at",
                          "attempts", "incident", "history"})


class NotTheOwner(AttributeError):
    """A write to a process's life from outside ``Watchlist.change``: a bug."""


@dataclass(frozen=True)
class ProgressMark:
    """Where a process stood when it was declared hung: what it must get past to be watched for a new hang."""

    beats: int | None  # its beat count; None when it never beat (its stack is the only sign)
    signature: tuple | None  # type: ignore[type-arg]  # its last plain stack; None when none was sampled
    moved: int = 0  # plain samples in a row since, each with a stack other than ``signature``


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP: Final = _Keep()  # Watchlist.change: leave this one as it is


@dataclass
class Watched:
    """The daemon's running record of one watched process (mutable, owned by the daemon loop)."""

    registration: Registration
    state: State
    seen_at: float  # monotonic: when the daemon first saw the registration
    timeout: float
    beat: Reading | None = None
    last_progress: float | None = None  # monotonic time of the last beat seen
    next_check: float = 0.0
    incident: str | None = None
    pidfd: int | None = None
    timeout_source: str = "config"  # "registration", "config" or "learned"
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=200))  # observed seconds per beat
    beats_observed: int = 0
    stack_timeout: float | None = None  # declared, or from the config's stack_timeouts
    history: StackHistory = field(default_factory=StackHistory)
    next_sample: float = float("inf")
    sampling: bool = False
    suspicion: Suspicion | None = None
    confirm_by: float = 0.0  # SUSPECT: by when the suspicion is confirmed or dropped
    idle_noted: bool = False  # a frozen but idle stack was logged once
    never_beat: bool = False  # no first beat within the startup grace and no declared timeout: its stack is watched instead
    role: str = "workload"  # "launcher" once known (declared, or a rank below it registered): never judged by beats
    mark: ProgressMark | None = None  # HUNG, CAPTURED: where it stood when declared
    retry_at: float | None = None  # HUNG: its capture failed (or was never queued); captured again then
    attempts: int = 0  # HUNG: captures of this hang that failed so far
    stack_timeout_source: str = "config"  # "registration" or "config" (stack_timeouts), where stack_timeout is set
    stack_window: float = 120.0  # the config's stack_window: what applies where no stack timeout is set
    series: tuple[Any, Any, float | None, int | None] | None = None  # its /metrics series and the values they hold

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OWNED and name in self.__dict__:
            raise NotTheOwner(f"Watched.{name} is written by Watchlist.change only")
        object.__setattr__(self, name, value)

    def applied_timeout(self) -> tuple[float, str]:
        """The timeout that decides this process's hang now, and where it comes from (status's TIMEOUT)."""
        if self.watched_by_stack:
            if self.stack_timeout is not None:
                return self.stack_timeout, f"stack, {self.stack_timeout_source}"
            return self.stack_window, "stack window, config"
        return self.timeout, f"heartbeat, {self.timeout_source}"

    @property
    def watched_by_stack(self) -> bool:
        if self.role == "launcher":
            return False
        return self.registration.beat_file is None or self.stack_timeout is not None or self.never_beat

    def notify_status(self) -> str | None:
        """The workload's last STATUS= text; None when there is none or its file is not to be trusted."""
        status_at = self.registration.status_at  # resolved once, at admission: never reopened by path
        if status_at is None:
            return None
        try:
            raw = status_at.read_bytes(STATUS_MAX, READ_DEADLINE)
        except untrusted.Refused:
            return None
        return raw.decode("utf-8", "replace").strip() or None

    def check_files(self) -> None:
        """Raise untrusted.Refused when the status file was swapped for a directory, FIFO, link or
        another user's file since the registration was accepted (the beat file is checked at each
        read), or the process now runs as another user (it exec'd a setuid program: nothing is
        done to it as root for its user any more). A missing status file is fine: it is written
        only once the workload sends STATUS=."""
        try:
            untrusted.check_owner(self.process.pid, self.registration.uid)
        except untrusted.Refused as exc:
            if exc.reason != "no_process":  # gone: its pidfd says so, as an exit
                raise
        if self.registration.status_at:
            try:
                fd = self.registration.status_at.open_fd(MAX_FILE)
            except untrusted.Refused as exc:
                if exc.reason != "missing":
                    raise untrusted.Refused(exc.reason, f"status file {exc}") from None
            else:
                os.close(fd)

    @property
    def process(self) -> ProcessId:
        return self.registration.process

    def summary(self) -> dict[str, Any]:
        r = self.registration
        age = (time.monotonic() - self.last_progress) if self.last_progress is not None else None
        return {
            "pid": r.process.pid, "start_time": r.process.start_time, "job": r.job, "rank": r.rank,
            "local_rank": r.local_rank, "world_size": r.world_size, "state": self.state.value,
            "timeout": self.timeout, "timeout_source": self.timeout_source, "stack_timeout": self.stack_timeout,
            "applied_timeout": list(self.applied_timeout()),
            "source": r.source, "role": self.role, "launcher": r.launcher, "notify_status": self.notify_status(),
            "beats": self.beat.count if self.beat else 0,
            "last_beat_age": round(age, 3) if age is not None else None,
            "last_beat_time": (time.time() - age) if age is not None else None,
            "beat_file": r.beat_file, "cmdline": list(r.cmdline), "incident": self.incident,
        }

    def departed(self, noticed_at: float) -> exits.Departed:
        """What the daemon knew of this process when it exited: its last beat read once more, its last stack."""
        beat = self.beat
        if self.registration.beat_at:
            try:
                beat = beat_segment.read(self.registration.beat_at)
            except (beat_segment.SegmentError, untrusted.Refused):
                pass  # removed at its exit already: what was last read stands
        last_beat = None
        if beat is not None and beat.count:
            last_beat = noticed_at - max(0.0, (time.monotonic_ns() - beat.last_ns) / 1e9)
        stack = self.history.samples[-1].signature if self.history.samples else ()
        return exits.Departed(self.registration, noticed_at, last_beat, beat.count if beat else 0, stack)


class Watchlist(dict[ProcessId, Watched]):
    """Every watched process by identity, and the one writer of each one's life (``change``).

    Counts by state are kept as they change (a change costs the same with one
    process or a thousand); every change of state is counted in
    ``hangwatchd_state_changes_total``, logged, and announced through
    ``on_change`` (the status file, which debounces)."""

    def __init__(self, metrics: Metrics, on_change: Callable[[], None] = lambda: None, limit: int | None = None) -> None:
        super().__init__()
        self.metrics = metrics
        self.on_change = on_change
        self.limit = limit  # most processes watched at once (None: only the per-user limits)
        self.counts: dict[State, int] = {s: 0 for s in State}
        # When each process is next due (a check or a sample): a heap the loop pops, so a loop turn
        # costs what is due, not one look at every process. Entries go stale when a timer moves;
        # ``due`` skips those, and the heap is rebuilt once stale ones outnumber live ones 4 to 1.
        self._due: list[tuple[float, int, ProcessId]] = []
        self._seq = itertools.count()
        self._gauges = {s: metrics.watched.labels(**metrics.labels(state=s.value)) for s in State if s is not State.EXITED}
        self._entered = {s: metrics.state_changes.labels(**metrics.labels(state=s.value)) for s in State}
        for g in self._gauges.values():
            g.set(0)

    def admit(self, w: Watched) -> bool:
        """Start watching ``w`` (False, and nothing kept, at ``limit``)."""
        if self.limit is not None and len(self) >= self.limit and w.process not in self:
            return False
        self[w.process] = w
        self._entered[w.state].inc()
        self._count(None, w.state)
        self._schedule(w)
        self.on_change()
        return True

    def _schedule(self, w: Watched) -> None:
        when = w.next_check if w.sampling else min(w.next_check, w.next_sample)  # a sample in flight is not due
        if when != float("inf"):
            heapq.heappush(self._due, (when, next(self._seq), w.process))
            if len(self._due) > 4 * len(self) + 1024:
                self.reschedule_all()

    def reschedule_all(self) -> None:
        """Rebuild the heap from every process's timers (drops stale entries; O(n))."""
        self._due = [(min(w.next_check, w.next_sample), next(self._seq), w.process) for w in self.values()
                     if min(w.next_check, w.next_sample) != float("inf")]
        heapq.heapify(self._due)

    def next_due(self) -> float:
        """The earliest time a process may be due (perhaps a stale entry's: an early wake-up is harmless)."""
        return self._due[0][0] if self._due else float("inf")

    def due(self, now: float) -> list[Watched]:
        """The processes with a check or a sample due by ``now``, each once."""
        out: list[Watched] = []
        seen: set[ProcessId] = set()
        while self._due and self._due[0][0] <= now:
            _, _, pid = heapq.heappop(self._due)
            w = self.get(pid)
            if w is None or pid in seen or min(w.next_check, w.next_sample) > now:
                continue  # gone, or its timer moved (a later entry stands for it)
            seen.add(pid)
            out.append(w)
        return out

    def forget(self, w: Watched) -> None:
        """``w`` is gone: its record goes, and with it everything of its life (marks, timers, suspicion)."""
        if self.get(w.process) is not w:
            return
        self.change(w, State.EXITED, why="forgotten")
        del self[w.process]
        self._count(State.EXITED, None)
        self.on_change()

    def change(self, w: Watched, state: State | None = None, *, why: str = "", suspicion: Any = KEEP,
               check_at: float | None = None, sample_at: float | None = None, confirm_by: float | None = None,
               mark: Any = KEEP, retry_at: Any = KEEP, attempts: int | None = None, incident: Any = KEEP,
               reset_history: bool = False) -> None:
        """The one transition of a process's life: its state and whatever hangs on it, together.

        Each keyword left out stays as it is. Entering HEALTHY or STARTING drops the hang's
        mark, retry and suspicion unless given; leaving HUNG ends its retry."""
        old = w.state
        put = object.__setattr__
        if state is not None and state is not old:
            if state in (State.HEALTHY, State.STARTING):
                mark = None if mark is KEEP else mark
                retry_at = None if retry_at is KEEP else retry_at
                suspicion = None if suspicion is KEEP else suspicion
                attempts = 0 if attempts is None else attempts
            if old is State.HUNG and retry_at is KEEP:
                retry_at = None
        # (field, value, what leaves it as it is): KEEP where None is a value to set
        for field, value, leave in (("suspicion", suspicion, KEEP), ("mark", mark, KEEP), ("retry_at", retry_at, KEEP),
                                    ("incident", incident, KEEP), ("attempts", attempts, None),
                                    ("confirm_by", confirm_by, None), ("next_check", check_at, None),
                                    ("next_sample", sample_at, None)):
            if value is not leave:
                put(w, field, value)
        if (check_at is not None or sample_at is not None) and w.process in self:
            self._schedule(w)
        if reset_history:
            put(w, "history", StackHistory())
        if state is None:
            return
        put(w, "state", state)
        if old is not state:
            self._entered[state].inc()
            if w.process in self:
                self._count(old, state)
            log.info("state_changed", pid=w.process.pid, job=w.registration.job, rank=w.registration.rank,
                     old=old.value, new=state.value, why=why or None)
            self.on_change()

    def _count(self, old: State | None, new: State | None) -> None:
        for s, d in ((old, -1), (new, 1)):
            if s is not None:
                self.counts[s] += d
                if s in self._gauges:
                    self._gauges[s].set(self.counts[s])

    def count_states(self) -> None:
        """The watched-processes gauge, from the counts kept."""
        for s, g in self._gauges.items():
            g.set(self.counts[s])
