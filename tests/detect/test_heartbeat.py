"""The heartbeat detector on a real beat segment (this process's, beaten here as ``hangwatchd.beat()``
does, each beat's monotonic time given): when it looks again, learning and learned."""

from __future__ import annotations

import itertools
import mmap
import os
import time
from pathlib import Path

from hangwatchd.detect import HeartbeatDetector
from hangwatchd.host import procfs
from hangwatchd.model import Registration, State
from hangwatchd.watch.watched import Watched
from hangwatchd.workload import beat_segment, registration_file

Writer = tuple[mmap.mmap, "itertools.count[int]"]  # a segment's mapping and its counter (open_for_writing)


def watched(tmp_path: Path, timeout: float | None) -> tuple[Watched, Writer]:
    """This process, registered with a segment of its own, as the daemon admits it; the segment's writer."""
    registration_file.prepare_dirs(tmp_path)
    me = procfs.identify(os.getpid())
    assert me is not None
    seg = tmp_path / "beats" / f"{me.pid}-{me.start_time}.beat"
    beat_segment.create(str(seg), me.pid)
    path = registration_file.write(tmp_path / "registrations",
                                   Registration(me, uid=os.getuid(), beat_file=str(seg), heartbeat_timeout=timeout))
    reg = registration_file.load(path, tmp_path / "beats")
    w = Watched(reg, State.HEALTHY, seen_at=time.monotonic(), timeout=timeout or 120.0,
                timeout_source="registration" if timeout else "config")
    return w, beat_segment.open_for_writing(str(seg))


def beat_and_look(det: HeartbeatDetector, w: Watched, writer: Writer, at: float) -> float:
    """A beat at ``at`` (monotonic), then the detector's look at that moment: when it looks next."""
    mm, counter = writer
    beat_segment.BEAT.pack_into(mm, beat_segment.BEAT_OFFSET, next(counter), int(at * 1e9))
    obs = det.observe(w, at)
    for name, value in obs.learned.items():  # what the state machine writes through Watchlist.change
        object.__setattr__(w, name, value)
    assert obs.state is State.HEALTHY
    return obs.next_check


def test_a_learned_timeout_is_looked_at_at_its_deadline_as_a_declared_one(tmp_path: Path) -> None:
    """Beats a second apart: looked at every second until 20 are seen and a timeout is learned (10
    times the interval), then at the deadline, as a declared timeout is, not every quarter of it."""
    det = HeartbeatDetector(startup_grace=60.0)
    w, writer = watched(tmp_path / "learned", None)
    start = time.monotonic()
    for k in range(1, 30):
        at = start + k
        next_check = beat_and_look(det, w, writer, at)
        if w.timeout_source != "learned":
            assert next_check - at <= 1.0  # learning: every second
    assert w.timeout_source == "learned" and abs(w.timeout - 10.0) < 0.01
    assert next_check == at + w.timeout  # its deadline: the last beat (now) and the timeout

    declared, writer = watched(tmp_path / "declared", 10.0)
    for k in range(1, 5):
        assert beat_and_look(det, declared, writer, start + k) == start + k + 10.0
