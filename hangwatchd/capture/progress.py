"""Is the process still making progress while it is captured? Its beats and its stack, looked at twice.

A rank of a job that is hung everywhere else but still beats, or whose stack
still moves, has left the lockstep: the job-wide analysis names it. This step
looks over a short window (it runs beside the other ranks' steps, so the
window costs no time on a node): the beat counter twice, and, for a process
that never beats, two non-pausing stack samples. The daemon takes the first
look with the capture's other steps and the second when it finishes the capture,
holding no worker while the window passes (``capture.base.WindowStep``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..host import subproc, untrusted
from ..host.deadline import Deadline
from ..host.pyspy_binary import find_pyspy
from ..model import Registration
from ..watch.stack_history import signature_of
from ..workload import beat_segment
from ..workload.runtime_files import write_json
from .base import Phase, StepFailed

WINDOW = 1.0


def _beats(target: Registration) -> beat_segment.Reading | None:
    if not target.beat_at:  # resolved at admission; a process nobody registered has none
        return None
    try:
        return beat_segment.read(target.beat_at)
    except (beat_segment.SegmentError, untrusted.Refused):
        return None


def _stack(pid: int, uid: int, deadline: Deadline) -> tuple[object, ...] | None:
    tool = find_pyspy()
    if tool is None:
        return None
    try:  # right before py-spy attaches: only while the process is still its user's alone
        untrusted.check_owner(pid, uid)
    except untrusted.Refused:
        return None
    res = subproc.run_by([tool, "dump", "--json", "--nonblocking", "--pid", str(pid)], deadline.at)
    if not res.ok:
        return None
    try:
        return signature_of(json.loads(res.stdout))
    except (ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class Opened:
    """The first look: when, and the beat counter then (or, for a process that never beats, its stack)."""

    at: float  # monotonic, once the look was taken
    beats: beat_segment.Reading | None
    stack: tuple[object, ...] | None = None


@dataclass
class ProgressStep:
    name: str = "progress"
    window: float = WINDOW
    phase: ClassVar[Phase] = Phase.BESIDE  # it only watches: the pipeline runs it beside the rank's other steps

    def window_by(self, deadline: Deadline) -> float:
        """The window, in the capture's time: at most a third of what is left of it."""
        return max(0.1, min(self.window, deadline.left() / 3))

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        window = self.window_by(deadline)
        opened = self.open(target, deadline)
        time.sleep(max(0.0, opened.at + window - time.monotonic()))
        return self.close(target, outdir, deadline, opened)

    def open(self, target: Registration, deadline: Deadline) -> Opened:
        before = _beats(target)
        if before is not None:
            return Opened(time.monotonic(), before)
        first = _stack(target.process.pid, target.uid, deadline.cut(deadline.left() / 3))
        return Opened(time.monotonic(), None, first)

    def close(self, target: Registration, outdir: Path, deadline: Deadline, opened: object) -> tuple[str, ...]:
        assert isinstance(opened, Opened)
        window = round(time.monotonic() - opened.at, 3)  # as it was: a capture finished later watched longer
        if opened.beats is not None:
            after = _beats(target)
            beats = (after.count - opened.beats.count) if after else 0
            data = {"window_seconds": window, "beats": beats, "beating": beats > 0,
                    "last_beat_age_seconds": after.age() if after else None, "stack_moved": None}
        else:
            second = _stack(target.process.pid, target.uid, deadline)
            if opened.stack is None or second is None:
                raise StepFailed("no beat segment and no readable stack: progress unknown")
            data = {"window_seconds": window, "beats": None, "beating": None, "stack_moved": opened.stack != second}
        data["progressing"] = bool(data["beating"] or data["stack_moved"])
        write_json(outdir / "progress.json", data)
        return ("progress.json",)
