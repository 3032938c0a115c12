"""The loop's rooms, in this process: a Daemon made in temporary dirs but never started; values
fed to its queue as the workers would post them; the capture workers' pool a stub that runs
nothing. What the loop does with each value is checked on the state it owns."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from hangwatchd.config import Config
from hangwatchd.daemon.capture_workers import CAPTURES_MAX, MAX_WAITING, CaptureDone, _Capture
from hangwatchd.daemon.inbox import Inbox
from hangwatchd.daemon.loop import Daemon
from hangwatchd.detect.machine import retry_pause
from hangwatchd.detect.sampler import SampleTaken
from hangwatchd.host import procfs
from hangwatchd.host.deadline import Deadline
from hangwatchd.metrics import create
from hangwatchd.model import ProcessId, Registration, State, Suspicion
from hangwatchd.watch.stack_history import Sample
from hangwatchd.watch.watched import Watched

from .conftest import ME, OTHER

WHY = Suspicion("heartbeat", "no beat for 9 s", 0.0, ("heartbeat",))


class StubPool:
    """The capture workers' pool: records what was handed to it, runs nothing."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        self.jobs.append((fn, args))
        return concurrent.futures.Future()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    cfg = Config(state_dir=str(tmp_path / "state"), runtime_dir=str(tmp_path / "run"), metrics_address="",
                 flight_recorder_warmup=False, captures_per_uid=1, gpu_dump="never")
    d = Daemon(cfg, create(CollectorRegistry(), node="unit"))
    d.workers.pool = StubPool()  # type: ignore[assignment]  # nothing is captured here
    yield d
    assert d.watched.illegal == 0
    if d.workers.act is not None:
        d.workers.act.stop()
    d.sampler.shutdown()
    d.registrations.stop()


_pids = iter(range(20_000_000, 30_000_000))


def watch(d: Daemon, uid: int, job: str, state: State = State.HEALTHY) -> Watched:
    w = Watched(Registration(ProcessId(next(_pids), 1), uid=uid, job=job), state, seen_at=0.0, timeout=10.0)
    assert d.watched.admit(w)
    return w


def hang(d: Daemon, w: Watched, now: float) -> None:
    """The machine declared ``w`` hung: the loop carries the Declare out."""
    d._act(d.machine.declare([w], WHY, now), now)


def pool(d: Daemon) -> StubPool:
    assert isinstance(d.workers.pool, StubPool)
    return d.workers.pool


def counter(d: Daemon, name: str, **labels: str) -> float:
    return d.metrics.registry.get_sample_value(name, {**d.metrics.const, **labels}) or 0.0


def test_a_saturated_user_budget_holds_that_users_hangs_never_anothers(daemon: Daemon) -> None:
    """captures_per_uid = 1: a user's second hang waits for the first (queued, HUNG, nothing lost),
    past MAX_WAITING the rest are HUNG with a retry due; another user's hang starts at once; and
    when the first capture's value comes back, the user's next one starts."""
    first = watch(daemon, ME, "a")
    hang(daemon, first, 0.0)
    assert first.state is State.HUNG and first.retry_at is None and len(pool(daemon).jobs) == 1
    waiting = [watch(daemon, ME, f"w{i}") for i in range(MAX_WAITING)]
    for w in waiting:
        hang(daemon, w, 1.0)
        assert w.state is State.HUNG and w.retry_at is None  # queued behind the first: its capture is coming
    assert len(daemon.workers.waiting[ME]) == MAX_WAITING and len(pool(daemon).jobs) == 1
    over = watch(daemon, ME, "over")
    hang(daemon, over, 2.0)
    assert over.state is State.HUNG and over.retry_at == 2.0 + retry_pause(1) and over.attempts == 1
    assert counter(daemon, "hangwatchd_registration_errors_total", reason="capture_budget") == MAX_WAITING + 1
    theirs = watch(daemon, OTHER, "a")
    hang(daemon, theirs, 3.0)
    assert theirs.retry_at is None and len(pool(daemon).jobs) == 2  # another user's hang: at once
    (capture_id,) = [c.id for c in daemon.workers.captures.values() if c.watched == [first]]
    daemon.inbox.post(CaptureDone(capture_id, "inc-1"))
    daemon._dispatch(4.0)
    assert first.state is State.CAPTURED and first.incident == "inc-1"
    assert len(pool(daemon).jobs) == 3 and len(daemon.workers.waiting[ME]) == MAX_WAITING - 1  # the next one of ME's


def test_a_full_capture_queue_leaves_the_hang_hung_with_its_retry_due(daemon: Daemon) -> None:
    for i in range(CAPTURES_MAX):
        daemon.workers.captures[10_000 + i] = _Capture([], [], WHY, 0.0, Deadline(100.0), 10_000 + i)
    w = watch(daemon, OTHER, "x")
    hang(daemon, w, 5.0)
    assert w.state is State.HUNG and w.retry_at == 5.0 + retry_pause(1) and pool(daemon).jobs == []
    daemon.workers.captures.clear()
    daemon._look(w, w.retry_at)  # its retry is due: queued now
    assert w.retry_at is None and len(pool(daemon).jobs) == 1


def test_a_capture_that_raised_comes_back_as_a_value_and_is_retried(daemon: Daemon) -> None:
    w = watch(daemon, OTHER, "x")
    hang(daemon, w, 0.0)
    ((fn, args),) = pool(daemon).jobs
    fn(*args)  # the worker, run here: make_incident raises (the state dir was never opened) ...
    daemon._dispatch(1.0)  # ... and its CaptureDone carries the error to the loop
    assert w.state is State.HUNG and w.attempts == 1 and w.retry_at == 1.0 + retry_pause(1)
    assert counter(daemon, "hangwatchd_loop_errors_total", where="capture") == 1 and daemon.workers.captures == {}


def test_a_sampler_that_raises_still_hands_its_process_back(daemon: Daemon) -> None:
    """py-spy could not even start (Popen out of descriptors): the sample comes back as its error,
    the process is no longer 'being sampled', and its next sample is due (before, it never was)."""
    def emfile(pid: int, timeout: float, native: bool, uid: int | None, act: object = None) -> Sample:
        raise OSError(errno.EMFILE, "Too many open files")

    daemon.sampler.take = emfile
    me = procfs.identify(os.getpid())  # the test's own process: alive, so its sample is judged
    assert me is not None
    w = Watched(Registration(me, uid=0, job=None), State.HEALTHY, seen_at=0.0, timeout=10.0, next_sample=0.0)
    assert daemon.watched.admit(w)
    daemon._sample(w, 1.0)
    daemon._start_samples()  # the turn's due samples, started together
    assert w.sampling
    assert select.select([daemon.inbox], [], [], 10.0)[0], "the sampler's value never came"
    daemon._dispatch(2.0)
    assert not w.sampling and w.next_sample == 2.0 + daemon.config.stack_interval
    assert counter(daemon, "hangwatchd_stack_samples_total", kind="plain", outcome="failed") == 1


def test_a_value_no_room_takes_is_a_counted_bug_and_the_loop_goes_on(daemon: Daemon) -> None:
    daemon.inbox.post(object())
    daemon.inbox.post(SampleTaken(ProcessId(1, 1), False, Sample(0.0, (), (), None, None)))  # of nobody watched: dropped
    daemon._dispatch(0.0)
    assert counter(daemon, "hangwatchd_loop_errors_total", where="object") == 1


def test_the_status_writer_gets_plain_data_made_on_the_loop(daemon: Daemon) -> None:
    posted: list[Any] = []
    daemon.status.post = posted.append  # type: ignore[method-assign,assignment]  # what the loop hands over, caught
    w = watch(daemon, ME, "a")
    daemon._write_status(5.0)
    ((row, reg),) = posted[0]
    assert type(row) is dict and reg is w.registration and row["state"] == "healthy" and row["job"] == "a"
    daemon.watched.change(w, State.SUSPECT, suspicion=WHY)
    assert row["state"] == "healthy"  # a copy: the loop's later changes never reach what the writer holds


def test_the_inbox_hands_values_over_in_order_and_wakes_the_loop() -> None:
    inbox = Inbox()
    def poster(i: int) -> None:
        for k in range(100):
            inbox.post((i, k))

    threads = [threading.Thread(target=poster, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert select.select([inbox], [], [], 0)[0]
    got = [m for m in inbox.drain() if isinstance(m, tuple)]
    assert len(got) == 400 and all([k for i2, k in got if i2 == i] == list(range(100)) for i in range(4))
    assert not select.select([inbox], [], [], 0)[0] and inbox.drain() == []
    inbox.close()


def test_a_deadline_is_absolute_and_only_ever_cut() -> None:
    d = Deadline.after(10.0, now=100.0)
    assert d.at == 110.0 and d.left(now=104.0) == 6.0 and d.left(now=200.0) == 0.0
    assert d.cut(3.0, now=104.0).at == 107.0 and d.cut(30.0, now=104.0) == d  # a step's own timeout, never past it
    assert d.sooner(4.0).at == 106.0 and d.passed(now=110.0) and not d.passed(now=109.9)
    assert time.monotonic() < Deadline.after(1.0).at


def test_a_slow_episode_is_captured_once_as_nobodys_hang_and_its_workers_values_reach_its_job(daemon: Daemon) -> None:
    """The pace machine's DeclareSlow: one capture queued (stacks and NVML only), no rank's life
    changes, the job's policy never acts on it; its incident comes back to the job's pace. The pace's
    workers' values (a sample, an NVML look, the other nodes' records) each reach their room."""
    from hangwatchd.daemon.pace_room import GpusLooked
    from hangwatchd.detect.pace_machine import DeclareSlow
    from hangwatchd.detect.sampler import PaceSampled
    from hangwatchd.fleet.paces import PacesRead
    from hangwatchd.model import JobPace
    from hangwatchd.watch.pace import SLOW, SLOWER, Pace

    assert daemon.pace is not None and daemon.workers.act is not None
    acted: list[Any] = []

    def after_store(*a: Any, **k: Any) -> list[int]:  # what the job's policy would be told
        acted.append(a)
        return []

    daemon.workers.act.after_store = after_store  # type: ignore[method-assign]  # caught, never carried out
    ranks = [watch(daemon, ME, "paced") for _ in range(2)]
    key = (ME, "paced")
    p = daemon.pace.paces[key] = Pace(key)
    assert daemon.pace.paces.change(p, SLOWER, why="unit", since=0.0) and daemon.pace.paces.change(p, SLOW, why="unit")
    record = JobPace("paced", ME, "unit", 0.0, 0.125, 0.1, "slow")
    daemon._act([DeclareSlow(key, tuple(ranks), Suspicion("slow", "25% slower", 0.0, ("pace",)), (record,))], 1.0)
    ((fn, args),) = pool(daemon).jobs
    (c,) = daemon.workers.captures.values()
    assert c.pace == key and c.watched == [] and [s.name for s, _ in daemon.workers.slow_steps] == ["proc", "pyspy", "nvml"]
    assert b'"records"' in args[-1]["slow.json"] and all(w.state is State.HEALTHY for w in ranks)
    daemon.inbox.post(CaptureDone(c.id, "inc-slow"))
    daemon._dispatch(2.0)
    assert p.incident == "inc-slow" and acted == [] and all(w.state is State.HEALTHY for w in ranks)
    assert counter(daemon, "hangwatchd_incidents_total", reason="slow") == 1
    daemon.inbox.post(PaceSampled(ranks[0].process, Sample(2.0, (), (), None, None, main="collective")))
    daemon.inbox.post(GpusLooked(key, 3.0, None, "no NVML here", absent=True))
    daemon.inbox.post(PacesRead(key, (JobPace("paced", ME, "other", 0.0, 0.125, 0.1, "slower"),)))
    daemon._dispatch(3.0)
    assert daemon.pace.nvml_absent_until > time.monotonic() and not daemon.pace._nvml_here()
    assert list(p.remote) == ["other"] and counter(daemon, "hangwatchd_loop_errors_total", where="PaceSampled") == 0
    assert counter(daemon, "hangwatchd_loop_errors_total", where="GpusLooked") == 0
