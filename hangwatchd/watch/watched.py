"""The daemon's running record of each watched process, and the one place its life changes.

A ``Registration`` is the frozen claim a workload made; a ``Watched`` is what
the daemon has learned of it since (its beats, its stack samples, its
timeout, its role). Every field of it that decides the process's fate - its
state and what hangs on the state (the suspicion, the timers, the progress
mark taken when it was declared hung, the capture's retry, its incident) and
what the detectors learned (beats, intervals, the learned timeout, the stack
history, whether it ever beat, whether it is a launcher) - changes only
through ``Watchlist.change``, on the loop thread: checked against the table of
legal transitions (``TRANSITIONS``), counted, logged and announced there, and
refused anywhere else (``Watched.__setattr__``). A process that goes is
dropped from the ``Watchlist`` with everything it held, at once
(``Watchlist.forget``). Workers never hold a ``Watched``: they get a
``Registration`` and hand back a value (daemon/loop.py).
"""

from __future__ import annotations

import heapq
import itertools
import os
import time
import traceback
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Final

import structlog

from ..host import untrusted
from ..metrics import Metrics
from ..model import ProcessId, Registration, State, Suspicion, is_job_mate
from ..workload import beat_segment, exits
from ..workload.beat_segment import Reading
from ..workload.registration_file import MAX_FILE, READ_DEADLINE
from .stack_history import StackHistory

log = structlog.get_logger("hangwatchd.daemon")

STATUS_MAX = 4096
INTERVALS_KEEP = 200  # observed beat intervals kept, the newest (what a timeout is learned from)

# The legal moves of a process's life (as nvidia-resiliency-ext's rank monitor keeps one table).
# A declaration takes a whole job's ranks here to HUNG, whatever their own look said (STARTING,
# HEALTHY or SUSPECT); a hung process shows progress (HEALTHY) or is captured; a captured one is
# watched again only once it progressed; a process watched by its stack that was suspect while
# starting goes back to STARTING; EXITED is the end. Anything else is a bug: logged with its
# traceback, counted, and not applied (Watchlist.change).
TRANSITIONS: Final[dict[State, frozenset[State]]] = {
    State.STARTING: frozenset({State.HEALTHY, State.SUSPECT, State.HUNG, State.EXITED}),
    State.HEALTHY: frozenset({State.STARTING, State.SUSPECT, State.HUNG, State.EXITED}),
    State.SUSPECT: frozenset({State.STARTING, State.HEALTHY, State.HUNG, State.EXITED}),
    State.HUNG: frozenset({State.CAPTURED, State.HEALTHY, State.EXITED}),
    State.CAPTURED: frozenset({State.HEALTHY, State.EXITED}),
    State.EXITED: frozenset(),
}
LIVE: Final = frozenset({State.STARTING, State.HEALTHY, State.SUSPECT})  # not hung, captured or gone

# The one field anyone may write: the cache of its /metrics series (it decides nothing).
FREE: Final = frozenset({"series"})


class NotTheOwner(AttributeError):
    """A write to a process's life from outside ``Watchlist.change``: a bug."""


@dataclass(frozen=True)
class ProgressMark:
    """Where a process stood when it was declared hung: what it must get past to be watched for a new hang."""

    beats: int | None  # its beat count; None when it never beat (its stack is the only sign)
    signature: tuple[tuple[tuple[str, str, int], ...], ...] | None  # its last plain stack; None when none was sampled
    moved: int = 0  # plain samples in a row since, each with a stack other than ``signature``
    beats_aside: bool = False  # it beat while its hung stack held still (a side thread beats): beats prove nothing, its stack must move


@dataclass
class Watched:
    """The daemon's running record of one watched process (owned by the daemon loop).

    Set when made, then written by ``Watchlist.change`` alone (``series`` apart)."""

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
    intervals: tuple[float, ...] = ()  # observed seconds per beat, the newest INTERVALS_KEEP
    beats_observed: int = 0
    stack_timeout: float | None = None  # declared, or from the config's stack_timeouts
    history: StackHistory = field(default_factory=StackHistory)
    next_sample: float = float("inf")
    sampling: bool = False  # a stack sample is being taken (its SampleTaken clears it, whatever happened)
    sampled_at: float | None = None  # monotonic: when its last stack sample came back (status.json says when)
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
        if name not in FREE and name in self.__dict__:
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
        return notify_status(self.registration)

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

    def status_row(self, now: float, wall: float) -> dict[str, Any]:
        """What status.json says of it: plain data, made on the loop (the writer adds ``notify_status``,
        read from the workload's own file off the loop, ``notify_status(registration)``)."""
        r = self.registration
        age = (now - self.last_progress) if self.last_progress is not None else None
        return {
            "pid": r.process.pid, "start_time": r.process.start_time, "job": r.job, "rank": r.rank,
            "local_rank": r.local_rank, "world_size": r.world_size, "state": self.state.value,
            "timeout": self.timeout, "timeout_source": self.timeout_source, "stack_timeout": self.stack_timeout,
            "applied_timeout": list(self.applied_timeout()),
            "source": r.source, "role": self.role, "launcher": r.launcher,
            "beats": self.beat.count if self.beat else 0,
            "last_beat_age": round(age, 3) if age is not None else None,
            "last_beat_time": (wall - age) if age is not None else None,
            "beat_file": r.beat_file, "cmdline": list(r.cmdline), "incident": self.incident,
            "last_sample_time": (wall - (now - self.sampled_at)) if self.sampled_at is not None else None,
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


def notify_status(reg: Registration) -> str | None:
    """The workload's last STATUS= text; None when there is none or its file is not to be trusted."""
    status_at = reg.status_at  # resolved once, at admission: never reopened by path
    if status_at is None:
        return None
    try:
        raw = status_at.read_bytes(STATUS_MAX, READ_DEADLINE)
    except untrusted.Refused:
        return None
    return raw.decode("utf-8", "replace").strip() or None


def job_mates(w: Watched, among: Iterable[Watched], states: Collection[State] = LIVE) -> list[Watched]:
    """``w``'s job-mates among ``among`` in one of ``states``: every caller's one list of who goes
    with a hang (``model.is_job_mate``: the same owner uid and job name, never a launcher)."""
    return [x for x in among if x is not w and x.state in states and is_job_mate(w.registration, x.registration, x.role)]


SETTABLE: Final = frozenset(f.name for f in fields(Watched)) - FREE - {"registration", "seen_at", "pidfd", "state"}


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
        self.illegal = 0  # transitions TRANSITIONS refused (each a bug, logged with its traceback)
        # When each process is next due (a check or a sample): a heap the loop pops, so a loop turn
        # costs what is due, not one look at every process. Entries go stale when a timer moves;
        # ``due`` skips those, and the heap is rebuilt once stale ones outnumber live ones 4 to 1.
        self._due: list[tuple[float, int, ProcessId]] = []
        self._seq = itertools.count()
        self._gauges = {s: metrics.watched.labels(**metrics.labels(state=s.value)) for s in State if s is not State.EXITED}
        self._entered = {s: metrics.state_changes.labels(**metrics.labels(state=s.value)) for s in State}
        self._illegal = metrics.loop_errors.labels(**metrics.labels(where="transition"))
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

    def change(self, w: Watched, state: State | None = None, *, why: str = "", check_at: float | None = None,
               sample_at: float | None = None, reset_history: bool = False, **values: Any) -> bool:
        """The one transition of a process's life: its state and whatever hangs on it, together.

        ``values``: fields of ``Watched`` to set (``SETTABLE``); each left out stays as it is.
        ``check_at``/``sample_at`` set its timers. Entering HEALTHY or STARTING drops the hang's
        mark, retry and suspicion unless given; leaving HUNG ends its retry. A move that
        ``TRANSITIONS`` does not allow is a bug: logged with its traceback, counted in
        ``hangwatchd_loop_errors_total{where="transition"}``, and nothing of it applied but its
        timers (the process is looked at again); False then."""
        unknown = values.keys() - SETTABLE
        if unknown:
            raise TypeError(f"Watchlist.change: no such field of a process's life: {', '.join(sorted(unknown))}")
        old = w.state
        put = object.__setattr__
        legal = state is None or state is old or state in TRANSITIONS[old]
        if not legal:
            assert state is not None
            self._refuse(w, old, state, why)
            values, state, reset_history = {}, None, False
        if state is not None and state is not old:
            if state in (State.HEALTHY, State.STARTING):
                for name, cleared in (("mark", None), ("retry_at", None), ("suspicion", None), ("attempts", 0)):
                    values.setdefault(name, cleared)
            if old is State.HUNG:
                values.setdefault("retry_at", None)
        if check_at is not None:
            values["next_check"] = check_at
        if sample_at is not None:
            values["next_sample"] = sample_at
        if reset_history:
            values["history"] = StackHistory()
        for name, value in values.items():
            put(w, name, value)
        if ("next_check" in values or "next_sample" in values or "sampling" in values) and w.process in self:
            self._schedule(w)
        if state is None or state is old:
            return legal
        put(w, "state", state)
        self._entered[state].inc()
        if w.process in self:
            self._count(old, state)
        log.info("state_changed", pid=w.process.pid, job=w.registration.job, rank=w.registration.rank,
                 old=old.value, new=state.value, why=why or None)
        self.on_change()
        return True

    def _refuse(self, w: Watched, old: State, new: State, why: str) -> None:
        self.illegal += 1
        self._illegal.inc()
        log.error("illegal_transition", pid=w.process.pid, job=w.registration.job, old=old.value, new=new.value,
                  why=why or None, allowed=sorted(s.value for s in TRANSITIONS[old]),
                  error=f"{old.value} -> {new.value} is not in TRANSITIONS (a bug)",
                  traceback="".join(traceback.format_stack(limit=12)[:-2]))

    def _count(self, old: State | None, new: State | None) -> None:
        for s, d in ((old, -1), (new, 1)):
            if s is not None:
                self.counts[s] += d
                if s in self._gauges:
                    self._gauges[s].set(self.counts[s])
