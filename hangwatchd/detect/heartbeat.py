"""The heartbeat detector: a process is hung when its beat counter stops for its timeout."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .. import heartbeat
from ..model import State, Suspicion
from ..registry import Watched
from .base import Observation


@dataclass
class HeartbeatDetector:
    startup_grace: float
    name: str = "heartbeat"

    def observe(self, w: Watched, now: float) -> Observation:
        path = w.registration.beat_file
        if path is None:
            return Observation(w.state, now + 3600.0)  # nothing to read: other detectors' business
        try:
            reading = heartbeat.read(path)
        except heartbeat.SegmentError as exc:
            return Observation(State.HUNG, now, Suspicion("heartbeat", f"beat segment unreadable: {exc}", time.time()))
        if w.beat is None or reading.count != w.beat.count:
            w.beat = reading
            if reading.count:
                # The beat's own monotonic timestamp, not when we happened to look.
                w.last_progress = reading.last_ns / 1e9
        if w.last_progress is None:
            deadline = w.seen_at + self.startup_grace
            if now >= deadline:
                return Observation(State.HUNG, now, Suspicion(
                    "heartbeat", f"no first beat within the startup grace of {self.startup_grace:g} s",
                    time.time() - (now - w.seen_at)))
            # A first beat raises no event: look again soon, so the timeout starts from it.
            return Observation(State.STARTING, min(deadline, now + min(1.0, w.timeout / 4)))
        deadline = w.last_progress + w.timeout
        if now >= deadline:
            silent = now - w.last_progress
            return Observation(State.HUNG, now, Suspicion(
                "heartbeat", f"no beat for {silent:.1f} s (timeout {w.timeout:g} s, {reading.count} beats before)",
                time.time() - silent))
        return Observation(State.HEALTHY, deadline)
