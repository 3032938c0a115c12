"""The state machine and its one writer, table-driven with a stub clock: every ``now`` is given."""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import Any

import pytest
import structlog

from hangwatchd.detect.base import Observation
from hangwatchd.detect.machine import HUNG_LOOK, retry_pause
from hangwatchd.detect.sampler import SampleTaken
from hangwatchd.host.activity import Activity
from hangwatchd.model import State, Suspicion
from hangwatchd.watch.stack_history import Sample
from hangwatchd.watch.watched import FREE, TRANSITIONS, NotTheOwner, Watched

from .conftest import ME, OTHER, Node, declares, hang


def pids(ws: tuple[Watched, ...]) -> set[int]:
    return {w.process.pid for w in ws}


PAIRS = [(a, b) for a in State for b in State if a is not b]


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
def test_every_move_is_checked_against_the_table(node: Node, old: State, new: State) -> None:
    """A legal move is made; an illegal one is refused (the state and what hangs on it stay), logged
    with its traceback, counted, and its timers still set, so the process is looked at again."""
    w = node.add(state=old)
    why = Suspicion("heartbeat", "x", 0.0)
    with structlog.testing.capture_logs() as logs:
        done = node.watched.change(w, new, why="table", suspicion=why, check_at=7.0)
    assert w.next_check == 7.0
    if new in TRANSITIONS[old]:
        assert done and w.state is new and node.watched.counts[new] == 1
        return
    assert not done and w.state is old and w.suspicion is None and node.watched.counts[old] == 1
    (line,) = [e for e in logs if e["event"] == "illegal_transition"]
    assert (line["old"], line["new"]) == (old.value, new.value) and "test_every_move_is_checked" in line["traceback"]
    assert node.counter("hangwatchd_loop_errors_total", where="transition") == 1
    node.watched.illegal = 0  # counted, as asserted: not a failure of this test


def test_nothing_but_the_transition_writes_a_process(node: Node) -> None:
    w = node.add()
    for f in dataclasses.fields(Watched):
        if f.name in FREE:
            continue
        with pytest.raises(NotTheOwner):
            setattr(w, f.name, getattr(w, f.name))
    with pytest.raises(TypeError, match="no such field"):
        node.watched.change(w, registration=w.registration)


def test_what_a_detector_learned_is_written_by_the_transition(node: Node) -> None:
    w = node.add()
    node.detector.says[w.process.pid] = Observation(State.HEALTHY, 5.0, learned={"timeout": 42.0, "timeout_source": "learned",
                                                                               "never_beat": True})
    assert node.machine.observe(w, 1.0) == []
    assert (w.timeout, w.timeout_source, w.never_beat, w.next_check) == (42.0, "learned", True, 5.0)


def test_a_learned_timeout_is_announced_when_learned_or_moved_not_at_every_look(node: Node) -> None:
    """status.json is rewritten (``on_change``) when a timeout is first learned and when it moves by a
    tenth or more; the small moves of each look wait for its regular rewrite (1,000 processes' looks
    rewrote it every second)."""
    w = node.add()
    announced: list[float] = []
    node.watched.on_change = lambda: announced.append(w.timeout)
    for now, timeout in ((1.0, 10.0), (2.0, 10.05), (3.0, 10.4), (4.0, 11.5), (5.0, 11.0)):
        node.detector.says[w.process.pid] = Observation(State.HEALTHY, now + 1.0,
                                                        learned={"timeout": timeout, "timeout_source": "learned"})
        assert node.machine.observe(w, now) == []
    assert announced == [10.0, 11.5]  # learned (its source changed), then moved by a tenth
    assert w.timeout == 11.0  # every move is kept, shown or not


def test_a_hang_is_confirmed_then_declared_with_one_deadline_and_handed_over(node: Node) -> None:
    w = node.add()
    d = node.declare(w, 100.0)
    assert d.group == (w,) and d.deadline.at == 101.0 + 30.0 and not d.retry
    assert w.state is State.SUSPECT  # nothing is HUNG before its capture is queued
    node.machine.handed_over(d, None, 101.0)
    assert w.state is State.HUNG and w.retry_at is None and w.mark is not None and w.next_check == 101.0 + HUNG_LOOK
    assert node.counter("hangwatchd_hangs_total", reason="heartbeat") == 1
    node.machine.stored(w, "inc-1")
    assert (w.state, w.incident, w.suspicion) == (State.CAPTURED, "inc-1", None)


def test_a_capture_that_cannot_be_queued_leaves_the_hang_hung_with_a_retry_due(node: Node) -> None:
    """The capture queue is full, or the user's budget is spent: HUNG with a retry, never HUNG with nothing coming."""
    w = node.add()
    d = node.declare(w, 0.0)
    node.machine.handed_over(d, "64 captures queued or running (CAPTURES_MAX)", 1.0)
    assert w.state is State.HUNG and w.attempts == 1 and w.retry_at == 1.0 + retry_pause(1) == w.next_check
    node.detector.says.pop(w.process.pid)
    assert node.machine.observe(w, 2.0) == []  # not yet
    (retry,) = declares(node.machine.observe(w, w.retry_at))
    assert retry.retry and retry.group == (w,)
    node.machine.handed_over(retry, "uid's capture budget is spent", w.retry_at)  # still no room: a longer pause
    assert w.attempts == 2 and w.retry_at is not None and w.retry_at - 6.0 == retry_pause(2)


def test_failed_captures_are_retried_after_a_pause_that_grows(node: Node) -> None:
    w = node.add()
    node.machine.handed_over(node.declare(w, 0.0), None, 1.0)
    now = 10.0
    for attempt in (1, 2, 3):
        node.machine.capture_failed(w, now)
        assert w.state is State.HUNG and w.attempts == attempt and w.retry_at == now + retry_pause(attempt)
        (retry,) = declares(node.machine.observe(w, w.retry_at))
        node.machine.handed_over(retry, None, w.retry_at)
        assert w.retry_at is None
        now += 1000.0


def test_a_retry_takes_only_its_own_users_job_mates(node: Node) -> None:
    """Two users run a job of the same name here: a retry of one's capture never captures the other's
    (before, the retry grouped by job name alone)."""
    mine, mate = node.add(uid=ME, rank=0), node.add(uid=ME, rank=1)
    theirs = node.add(uid=OTHER, rank=0)
    d = node.declare(mine, 0.0)
    assert pids(d.group) == pids((mine, mate))  # the first declaration: the same owner's ranks
    node.machine.handed_over(d, None, 1.0)
    d2 = node.declare(theirs, 2.0)
    assert d2.group == (theirs,)
    node.machine.handed_over(d2, None, 3.0)
    for w in (mine, mate, theirs):
        node.machine.capture_failed(w, 10.0)
    (retry,) = declares(node.machine.observe(mine, 10.0 + retry_pause(1)))
    assert pids(retry.group) == pids((mine, mate))


def test_a_sample_that_failed_still_ends_the_sampling_and_the_next_is_due(node: Node) -> None:
    w = node.add(job=None)
    node.watched.change(w, sampling=True, sample_at=0.0)
    failed = Sample(3.0, (), (), None, None, "the sampler raised OSError: [Errno 24] Too many open files")
    assert node.machine.sample_taken(w, SampleTaken(w.process, False, failed), 3.0) == []
    assert not w.sampling and w.next_sample == 3.0 + node.machine.cfg.stack_interval  # watched by its stack: again
    assert node.counter("hangwatchd_stack_samples_total", kind="plain", outcome="failed") == 1
    assert w.process in [x.process for x in node.watched.due(3.0 + node.machine.cfg.stack_interval)]


def test_a_frozen_stack_blocked_on_the_gpu_is_declared_and_an_idle_one_is_not(node: Node) -> None:
    busy, idle = node.add(job=None), node.add(job=None)
    cfg = node.machine.cfg
    for w, frames in ((busy, ("synchronize", "step")), (idle, ("idle_wait", "serve"))):
        t = 0.0
        while w.state is not State.SUSPECT and not w.idle_noted:  # plain samples of one stack, for the window
            s = Sample(t, ((("f", "x.py", 1),),), frames, 1.0, 1)
            node.machine.sample_taken(w, SampleTaken(w.process, False, s), t)
            t += cfg.stack_interval
        assert t - cfg.stack_interval == cfg.stack_window
        if w is idle:  # its Python frames wait where servers wait: idle, with no native look to take
            assert w.state is State.HEALTHY and w.next_sample == cfg.stack_window + cfg.stack_interval
            continue
        assert w.next_sample == cfg.stack_window  # now: its one native look
        native = Sample(t, ((("g", "x.so", 0),),), frames, 1.0, 1)
        (d,) = declares(node.machine.sample_taken(w, SampleTaken(w.process, True, native), t))
        assert d.suspicion.reason == "stack" and "blocked in synchronize" in d.suspicion.detail


def test_a_captured_process_is_declared_again_only_after_progress(node: Node) -> None:
    w = node.add(job=None)
    node.machine.handed_over(node.declare(w, 0.0), None, 1.0)
    node.machine.stored(w, "inc-1")
    node.detector.says.pop(w.process.pid)
    assert node.machine.observe(w, 50.0) == [] and w.state is State.CAPTURED  # no beats, no stack: no progress
    for t, sig in ((60.0, "a"), (65.0, "b")):  # two plain samples in a row unlike the hung stack (none was sampled)
        node.machine.sample_taken(w, SampleTaken(w.process, False, Sample(t, (((sig, "x.py", 1),),), (sig,), 1.0, 1)), t)
    assert w.state is State.CAPTURED  # the first one became the mark, the second differs: one in a row
    node.machine.sample_taken(w, SampleTaken(w.process, False, Sample(70.0, ((("c", "x.py", 1),),), ("c",), 1.0, 1)), 70.0)
    assert w.state is State.HEALTHY and w.mark is None and w.incident == "inc-1"


def _still_window(node: Node, w: Watched, frames: tuple[str, ...], native_extra: dict[str, object],
                  plain: list[dict[str, object]]) -> list:
    """Plain samples of one stack over the window (each with ``plain[i]``'s fields), then the native
    look; none where the plain samples showed work by the window (its run starts over, no look)."""
    cfg = node.machine.cfg
    t, i = 0.0, 0
    while w.state is not State.SUSPECT:
        extra = plain[min(i, len(plain) - 1)]
        s = Sample(t, ((("f", "x.py", 1),),), frames, 1.0, 1, **extra)  # type: ignore[arg-type]
        node.machine.sample_taken(w, SampleTaken(w.process, False, s), t)
        if i and w.history.count == 0:
            return []  # excused at the window by what the plain samples showed
        t, i = t + cfg.stack_interval, i + 1
    native = Sample(t, ((("g", "x.so", 0),),), frames, 1.0, 1, **native_extra)  # type: ignore[arg-type]
    return node.machine.sample_taken(w, SampleTaken(w.process, True, native), t)


def _act(t: float, cpu: float = 0.0, wait: float = 0.0, io: int = 0, kids: float = 0.0, n_kids: int = 0,
         kids_wait: float = 0.0) -> Activity:
    return Activity(t, int(cpu * 1e9), int(wait * 1e9), io, int(kids * 1e9), n_kids, int(kids_wait * 1e9))


@pytest.mark.parametrize(("what", "start", "end", "running", "why"), [
    ("a checkpoint written in one C call", _act(0), _act(10, io=50_000_000), False, "read or wrote"),
    ("a slow pipeline's consumer got one small int through a multiprocessing queue", _act(0), _act(10, io=9), False,
     "read or wrote 9 bytes"),
    ("a child that compiles", _act(0, n_kids=1), _act(10, kids=9.0, n_kids=1), False, "child processes used"),
    ("a child that compiles on a loaded node", _act(0, n_kids=1), _act(10, kids=1.0, n_kids=1, kids_wait=6.0), False,
     "waited 0.6 for a CPU"),
    ("gloo's threads reduce on a loaded node", _act(0), _act(10, cpu=3.0, wait=4.0), False, "non-Python threads wanted"),
])
def test_a_still_stack_whose_process_works_is_not_declared(node: Node, what: str, start: Activity, end: Activity,
                                                           running: bool, why: str) -> None:
    w = node.add(job=None)
    with structlog.testing.capture_logs() as logs:
        decided = _still_window(node, w, ("synchronize", "step"), {"activity": end, "python_running": running},
                                [{"activity": start, "python_running": running}])
    assert declares(decided) == [] and w.state is State.HEALTHY, what
    assert why in _excused(logs), what


def test_a_paused_beat_over_a_running_thread_whose_locals_read_alike_needs_five_samples(node: Node) -> None:
    """A learned timeout's pause over a Python thread on the CPU whose locals read the same in every
    sample (a spin, or a counter py-spy read torn alike three times): three samples declare nothing,
    as two would for any other stack; the fifth does."""
    w = node.add()
    node.watched.change(w, timeout=5.0, timeout_source="learned")
    node.detector.says[w.process.pid] = hang(0.0)
    assert node.machine.observe(w, 0.0) == [] and w.state is State.SUSPECT
    found = []
    for i in range(5):
        s = Sample(float(i), ((("checkpoint", "x.py", 6),),), ("checkpoint",), float(i), i, python_running=True,
                   locals_digest=7)
        found.append(bool(declares(node.machine.sample_taken(w, SampleTaken(w.process, False, s), float(i)))))
    assert found == [False, False, False, False, True]


def test_a_wake_up_byte_alone_is_not_work(node: Node) -> None:
    """One byte read on an event pipe (a loop woken, then stuck again) lets no still stack be."""
    w = node.add(job=None)
    node.watched.change(w, stack_timeout=5.0)
    (d,) = declares(_still_window(node, w, ("select", "run"), {"activity": _act(10, io=1)}, [{"activity": _act(0)}]))
    assert "declared --stack-timeout" in d.suspicion.detail


def _excused(logs: list[MutableMapping[str, Any]]) -> str:
    """Why the machine let a still stack be, as its log says."""
    (line,) = [e for e in logs if e["event"] == "stack_frozen_working"]
    return str(line["why"])


def test_a_python_thread_spinning_with_the_same_locals_is_declared_however_busy(node: Node) -> None:
    """CPU alone never excuses a Python thread that runs at one line with its variables unchanged."""
    w = node.add(job=None)
    with structlog.testing.capture_logs() as logs:
        declared = _still_window(node, w, ("wait_for_device", "run"), {"activity": _act(10, cpu=10.0), "python_running": True},
                                 [{"activity": _act(0), "python_running": True, "locals_digest": 7}])
    # A spin is blocked on nothing a pattern names: undeclared, it is let be as idle, never as working.
    assert declared == [] and w.state is State.HEALTHY and not any(e["event"] == "stack_frozen_working" for e in logs)
    w2 = node.add(job=None)
    node.watched.change(w2, stack_timeout=5.0)
    (d,) = declares(_still_window(node, w2, ("wait_for_device", "run"), {"activity": _act(10, cpu=10.0), "python_running": True},
                                  [{"activity": _act(0), "python_running": True, "locals_digest": 7}]))
    assert "declared --stack-timeout" in d.suspicion.detail


def test_a_still_stack_whose_locals_are_rebound_computes(node: Node) -> None:
    w = node.add(job=None)
    node.watched.change(w, stack_timeout=5.0)
    with structlog.testing.capture_logs() as logs:
        decided = _still_window(node, w, ("tokenize_corpus",), {"activity": _act(10, cpu=5.0), "python_running": True},
                                [{"activity": _act(0), "python_running": True, "locals_digest": n} for n in range(20)])
    assert declares(decided) == [] and w.state is State.HEALTHY and "local variables changed" in _excused(logs)


LISTENING = {"listening": [{"port": 8000, "backlog": 0}], "unread": [], "complete": True}


def test_a_server_waiting_for_work_it_does_not_have_is_idle_and_one_with_work_waiting_is_hung(node: Node) -> None:
    quiet, busy = node.add(job=None), node.add(job=None)
    frames = ("idle_wait", "serve")  # the node's idle pattern: where servers wait for work
    for w in (quiet, busy):
        node.watched.change(w, stack_timeout=5.0)
    with structlog.testing.capture_logs() as logs:
        assert _still_window(node, quiet, frames, {"activity": _act(10), "io": LISTENING}, [{"activity": _act(0)}]) == []
    assert quiet.state is State.HEALTHY and _excused(logs).startswith("idle: it waits for work and has none")
    waiting = {"listening": [{"port": 8000, "backlog": 3}], "unread": [], "complete": True}
    (d,) = declares(_still_window(node, busy, frames, {"activity": _act(10), "io": waiting}, [{"activity": _act(0)}]))
    assert "3 connections waiting to be accepted" in d.suspicion.detail
