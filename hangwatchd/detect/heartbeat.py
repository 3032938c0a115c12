"""The heartbeat detector: a process is suspect when its beat counter stops for its timeout.

When a process declared no timeout, one is learned from its beats once enough
are seen: a multiple of the longest recent interval, between a floor and a
ceiling, following the job as it moves between phases.

A process that has never beaten is not hung for it: a launcher (torchrun and
the like) is never judged by beats, and a workload that declared no timeout
and sends no first beat within the startup grace (an idle server, a program
that never imports hangwatchd) is handed to the stack detector, once, with a
log line. The heartbeat applies from its first beat, or from the start when
it declared a timeout (``--heartbeat-timeout``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import structlog

from ..model import State, Suspicion
from ..watch.watched import INTERVALS_KEEP, Watched
from ..workload import beat_segment
from .base import Observation

log = structlog.get_logger("hangwatchd.detect")


@dataclass
class HeartbeatDetector:
    startup_grace: float
    learn: bool = True
    factor: float = 10.0
    floor: float = 5.0
    ceiling: float = 1800.0
    min_beats: int = 20
    name: str = "heartbeat"

    def observe(self, w: Watched, now: float) -> Observation:
        """Its beats read now; what they say, and what was learned (``Observation.learned``)."""
        learned: dict[str, Any] = {}
        obs = self._judge(w, now, learned)
        return dataclasses.replace(obs, learned=learned) if learned else obs

    def _judge(self, w: Watched, now: float, learned: dict[str, Any]) -> Observation:
        beat_at = w.registration.beat_at  # resolved once, at admission: never reopened by path
        if beat_at is None:
            return Observation(w.state, now + 3600.0)  # nothing to read: the stack detector's business
        try:
            reading = beat_segment.read(beat_at)
        except beat_segment.SegmentError as exc:
            return Observation(State.SUSPECT, now, Suspicion("heartbeat", f"beat segment unreadable: {exc}", time.time(), ("heartbeat",)))
        last_progress, never_beat = w.last_progress, w.never_beat
        if w.beat is None or reading.count != w.beat.count:
            if w.beat is not None and w.beat.count and reading.count > w.beat.count:
                beats = reading.count - w.beat.count
                intervals = (*w.intervals[-(INTERVALS_KEEP - 1):], (reading.last_ns - w.beat.last_ns) / 1e9 / beats)
                learned.update(intervals=intervals, beats_observed=w.beats_observed + beats)
                learned.update(self._learn(w, intervals, w.beats_observed + beats))
            learned["beat"] = reading
            if reading.count:
                # The beat's own monotonic timestamp, not when we happened to look.
                last_progress = learned["last_progress"] = reading.last_ns / 1e9
                if never_beat:
                    never_beat = learned["never_beat"] = False  # it beats after all: the heartbeat applies from now
                    log.info("first_beat_late", pid=w.process.pid, after=round(now - w.seen_at, 1))
        timeout = learned.get("timeout", w.timeout)
        source = learned.get("timeout_source", w.timeout_source)
        if last_progress is None and w.role == "launcher":
            # Its ranks beat, it never does: its exit is what matters (the pidfd tells).
            return Observation(State.HEALTHY, now + 5.0)
        if last_progress is None and w.registration.heartbeat_timeout is None:
            deadline = w.seen_at + self.startup_grace
            if now >= deadline and not never_beat:
                never_beat = learned["never_beat"] = True  # from now on its stack is sampled (see Watched.watched_by_stack)
                log.warning("never_beat", pid=w.process.pid, job=w.registration.job, rank=w.registration.rank,
                            grace=self.startup_grace, watched_by="stack",
                            note="no first beat and no declared --heartbeat-timeout: watched by its stack, never hung for a missing beat")
            state = State.HEALTHY if never_beat else State.STARTING
            return Observation(state, (now + 1.0) if never_beat else min(deadline, now + min(1.0, timeout / 4)))
        if last_progress is None:
            deadline = w.seen_at + self.startup_grace
            if now >= deadline:
                return Observation(State.SUSPECT, now, Suspicion(
                    "heartbeat", f"no first beat within the startup grace of {self.startup_grace:g} s",
                    time.time() - (now - w.seen_at), ("heartbeat",)))
            # A first beat raises no event: look again soon, so the timeout starts from it.
            return Observation(State.STARTING, min(deadline, now + min(1.0, timeout / 4)))
        deadline = last_progress + timeout
        if now >= deadline:
            silent = now - last_progress
            return Observation(State.SUSPECT, now, Suspicion(
                "heartbeat", f"no beat for {silent:.1f} s (timeout {timeout:g} s, {source}; "
                f"{reading.count} beats before)", time.time() - silent, ("heartbeat",)))
        if self._learning(source) and source != "learned":
            # Looks every second until it has a timeout of its own (the deadline never passed over).
            return Observation(State.HEALTHY, min(deadline, now + min(1.0, max(0.25, timeout / 4))))
        # Then at its deadline, as a declared one: each look learns from the beats since the last (their
        # mean interval). Looked at every quarter of it, 1,000 learned processes cost the daemon twice
        # what 1,000 declared ones did (bench/scale.py); a longer phase is learned as before, by the
        # suspicion its first pause raises, which the stack confirms or lets be.
        return Observation(State.HEALTHY, deadline)

    def _learning(self, source: str) -> bool:
        return self.learn and source != "registration"

    def _learn(self, w: Watched, intervals: tuple[float, ...], observed: int) -> dict[str, Any]:
        """The timeout learned from these intervals, where there is one to learn yet."""
        if not self._learning(w.timeout_source) or observed < self.min_beats or len(intervals) < 3:
            return {}
        return {"timeout": min(self.ceiling, max(self.floor, self.factor * max(intervals))), "timeout_source": "learned"}
