"""A capture in turns: no capture worker waits out the progress window or the slow evidence.

A Daemon made in temporary dirs and never started: the loop's turns are run here by hand (what
the workers post is drained from its queue and handed to it). The capture workers are real (one
worker thread), and so are the captured processes, py-spy, the store and the progress step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry

from hangwatchd.capture import make_steps
from hangwatchd.capture.base import Phase
from hangwatchd.config import Config
from hangwatchd.daemon.capture_workers import CaptureDone, CaptureLooked
from hangwatchd.daemon.loop import Daemon
from hangwatchd.daemon.work_pool import WorkPool
from hangwatchd.host import procfs
from hangwatchd.host.deadline import Deadline
from hangwatchd.metrics import create
from hangwatchd.model import Registration, State, Suspicion
from hangwatchd.testing import stop, wait_for
from hangwatchd.watch.watched import Watched

WHY = Suspicion("heartbeat", "no beat for 9 s", 0.0, ("heartbeat",))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    cfg = Config(state_dir=str(tmp_path / "state"), runtime_dir=str(tmp_path / "run"), metrics_address="",
                 flight_recorder_warmup=False, gpu_dump="never", capture_steps=("proc", "progress", "pyspy", "flight_recorder"),
                 pyspy_native=False, slow_jobs=False)
    d = Daemon(cfg, create(CollectorRegistry(), node="unit"))
    assert d.store.open() is None
    d.workers.pool = WorkPool(1, "capture")  # one worker: the hangs' captures take turns on it
    yield d
    d.workers.shutdown()
    if d.workers.act is not None:
        d.workers.act.stop()
    d.sampler.shutdown()
    d.registrations.stop()


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    # Ready once asleep: its one Python frame is the same line before and after (py-spy shows no C frames).
    procs = [subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE) for _ in range(2)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    yield procs
    stop(*procs)


def hang_each(d: Daemon, procs: list[subprocess.Popen[bytes]], jobs: str = "") -> list[Watched]:
    """Each process watched as a job of its own, and declared hung now."""
    out = []
    for i, p in enumerate(procs):
        me = procfs.identify(p.pid)
        assert me is not None
        w = Watched(Registration(me, uid=os.getuid(), job=f"job{jobs}{i}"), State.HEALTHY, seen_at=0.0, timeout=10.0)
        assert d.watched.admit(w)
        out.append(w)
    now = time.monotonic()
    for w in out:
        d._act(d.machine.declare([w], WHY, now), now)
    assert all(w.state is State.HUNG for w in out)
    return out


def posted(d: Daemon, kind: type, n: int, seconds: float = 60.0) -> list[object]:
    """What the workers posted, drained until ``n`` of ``kind`` came; each handed to the loop after."""
    got: list[object] = []

    def enough() -> bool:
        got.extend(d.inbox.drain())
        return sum(isinstance(m, kind) for m in got) >= n

    wait_for(enough, seconds, f"{n} {kind.__name__}", every=0.02)
    return got


def deliver(d: Daemon, messages: Sequence[object]) -> None:
    for m in messages:
        d._deliver(m, time.monotonic())


def test_a_capture_waiting_out_its_progress_window_holds_no_worker(daemon: Daemon, sleepers: list[subprocess.Popen[bytes]]) -> None:
    """Two hangs, one worker: both captures look (stacks, the window's first look) before either is
    finished, which the loop has done once the window has passed; each incident holds one progress
    result, its window as long as it was. The flight recorder, not there (n/a), said so as first
    stored: nothing is coming."""
    ws = hang_each(daemon, sleepers)
    first = posted(daemon, CaptureLooked, 2)
    assert not any(isinstance(m, CaptureDone) for m in first), first  # the worker did not wait out the first's window
    deliver(daemon, first)
    due = daemon.workers.next_due()
    last = max(m.ready_at for m in first if isinstance(m, CaptureLooked))
    assert due <= last < float("inf")
    daemon.workers.resume(due - 0.5)
    assert daemon.workers.next_due() == due  # not yet handed back
    time.sleep(max(0.0, last - time.monotonic()))
    daemon.workers.resume(time.monotonic())
    done = posted(daemon, CaptureDone, 2)
    deliver(daemon, done)
    assert all(w.state is State.CAPTURED and w.incident for w in ws)
    for w in ws:
        incident_dir = daemon.store.dir / str(w.incident)
        incident = json.loads((incident_dir / "incident.json").read_text())
        steps = incident["processes"][0]["steps"]
        assert [s["step"] for s in steps] == ["proc", "progress", "pyspy", "flight_recorder"]  # one result for the two looks
        assert steps[-1]["not_applicable"] and incident["pending"] == []
        progress = json.loads((incident_dir / str(w.process.pid) / "progress.json").read_text())
        assert progress["window_seconds"] >= 1.0 and progress["stack_moved"] is False and not progress["progressing"]
    duration = daemon.metrics.registry.get_sample_value("hangwatchd_capture_step_duration_seconds_count",
                                                         {**daemon.metrics.const, "step": "progress"})
    assert duration == 2  # counted once a capture, not once a look


class HeldLate:
    """A slow step (a flight recorder taking its time): on ``hold``'s process it answers when told to."""

    name = "slow_trace"
    phase: ClassVar[Phase] = Phase.LATE

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.release = threading.Event()

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        if target.process.pid == self.hold:
            self.release.wait(deadline.left())
        (outdir / "fr.txt").write_text("the trace")
        return ("fr.txt",)


def finish_looked(d: Daemon, n: int) -> list[object]:
    """The loop's part, by hand: ``n`` captures that looked, each handed back once its window passed;
    what else the workers posted meanwhile."""
    messages = posted(d, CaptureLooked, n)
    looked = [m for m in messages if isinstance(m, CaptureLooked)]
    deliver(d, looked)
    time.sleep(max(0.0, max(m.ready_at for m in looked) - time.monotonic()))
    d.workers.resume(time.monotonic())
    assert d.workers.next_due() == float("inf")
    return [m for m in messages if not isinstance(m, CaptureLooked)]


def test_slow_evidence_is_waited_for_off_the_workers(daemon: Daemon, sleepers: list[subprocess.Popen[bytes]]) -> None:
    """Two hangs, one worker, the first's slow evidence held back: the first is stored (its trace
    said to be coming), and the second is captured and stored and done meanwhile; the first's
    capture is done once its trace is in."""
    held = HeldLate(hold=sleepers[0].pid)
    daemon.workers.steps = [*make_steps(daemon.config), (held, 60.0)]
    (first,) = hang_each(daemon, sleepers[:1], "a")
    messages = finish_looked(daemon, 1)

    def row(w: Watched) -> dict[str, Any] | None:
        return next((r for r in daemon.store.list() if w.process.pid in r["processes"]), None)

    assert wait_for(lambda: row(first), 30, "the first incident stored")["pending"]  # its trace still coming
    (second,) = hang_each(daemon, sleepers[1:], "b")  # the one worker is free for it
    messages += finish_looked(daemon, 1)
    messages += posted(daemon, CaptureDone, 1)
    (done,) = [m for m in messages if isinstance(m, CaptureDone)]
    assert daemon.workers.captures[done.capture].watched == [second]
    held.release.set()
    messages += posted(daemon, CaptureDone, 1)  # the first's
    deliver(daemon, messages)
    assert first.state is State.CAPTURED and second.state is State.CAPTURED
    assert (daemon.store.dir / str(first.incident) / str(first.process.pid) / "fr.txt").read_text() == "the trace"
    assert not row(first)["pending"]  # type: ignore[index]  # stored above


def test_the_workers_finish_what_is_under_way_before_starting_more() -> None:
    """A capture whose window has passed (``first``) is taken before captures not started yet; at
    shutdown, work not started is cancelled, work under way still runs."""
    pool = WorkPool(1, "test")
    busy, order = threading.Event(), list[str]()
    pool.submit(busy.wait)
    new = [pool.submit(order.append, f"new{i}") for i in range(2)]
    pool.submit(order.append, "first", first=True)
    busy.set()
    for f in new:
        f.result(10)
    assert order == ["first", "new0", "new1"]
    busy.clear()
    pool.submit(busy.wait)
    dropped = pool.submit(order.append, "dropped")
    kept = pool.submit(order.append, "kept", first=True)
    pool.shutdown(wait=False)
    busy.set()
    pool.shutdown(wait=True)
    assert dropped.cancelled() and kept.done() and order[-1] == "kept"
