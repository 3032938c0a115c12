"""The daemon's running record of each watched process: what the watch, detect and capture stages read.

A ``Registration`` is the frozen claim a workload made; a ``Watched`` is what
the daemon has learned of it since (its state, its beats, its stack samples,
its suspicion). The ``Watchlist`` holds them all by identity and is the one
place a state changes (counted, logged, announced). The loop owns it and is
its only writer; the detectors read and update the record they are handed.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    """Every watched process by identity. A state changes here only: counted in
    ``hangwatchd_state_changes_total``, logged, and announced through ``on_change``
    (the status file)."""

    def __init__(self, metrics: Metrics, on_change: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.metrics = metrics
        self.on_change = on_change

    def set_state(self, w: Watched, state: State) -> None:
        old = w.state
        w.state = state
        self.metrics.state_changes.labels(**self.metrics.labels(state=state.value)).inc()
        self.count_states()
        if old is not state:
            log.info("state_changed", pid=w.process.pid, job=w.registration.job, rank=w.registration.rank,
                     old=old.value, new=state.value)
        self.on_change()

    def count_states(self) -> None:
        for s in State:
            if s is not State.EXITED:  # exited processes are forgotten, not watched
                self.metrics.watched.labels(**self.metrics.labels(state=s.value)).set(
                    sum(1 for x in self.values() if x.state is s))
