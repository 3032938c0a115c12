"""The stack sampler on real processes and real py-spy: one sampler serves many processes, each
gets its own stack; a process that has not run since its stack was read is given that stack
again without py-spy, and one that ran is read again; a read after a freeze knows since when the
stack held; a user's py-spy budget is spent only by reads."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from hangwatchd.detect.quiet import Quiet
from hangwatchd.detect.sampler import SampleBatch, Sampler, SampleTaken
from hangwatchd.host import procfs
from hangwatchd.host.pyspy_binary import find_pyspy
from hangwatchd.host.user_limits import UserLimits
from hangwatchd.model import Registration
from hangwatchd.watch.stack_history import Sample

pytestmark = pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")

# Each waits in a function named after it, until a line on stdin asks it to move to the next one.
WORKER = """
import sys
name = sys.argv[1]
BODY = "def {}():\\n    print('ready', flush=True)\\n    return sys.stdin.readline()\\n"
exec(BODY.format("wait_" + name) + BODY.format("then_" + name))
globals()["wait_" + name]()
globals()["then_" + name]()
"""


def _ready(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"


def _spawn(n: int, user: int | None = None) -> list[subprocess.Popen[str]]:
    # Another user cannot run root's interpreter under /root: the system's (standard library only here).
    python = "/usr/bin/python3" if user is not None else sys.executable
    procs = [subprocess.Popen([python, "-c", WORKER, f"w{i}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True, user=user) for i in range(n)]
    for p in procs:
        _ready(p)
    time.sleep(0.3)  # past the print: each waits in its read
    return procs


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[str]]]:
    procs = _spawn(6)
    try:
        yield procs
    finally:
        _stop(procs)


@pytest.fixture
def budgeted() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes of a uid that has a py-spy budget: nobody's as root, our own otherwise."""
    if os.geteuid() == 0 and not os.path.exists("/usr/bin/python3"):
        pytest.skip("as root, another user's processes are run with /usr/bin/python3, which is not here")
    procs = _spawn(6, 65534 if os.geteuid() == 0 else None)
    try:
        yield procs
    finally:
        _stop(procs)


def _reg(p: subprocess.Popen[str]) -> Registration:
    me = procfs.identify(p.pid)
    uid = procfs.uid(p.pid)
    assert me is not None and uid is not None
    return Registration(process=me, uid=uid, beat_file=None)


def _round(sampler: Sampler, inbox: queue.Queue[object], regs: list[Registration],
           last: dict[int, Sample] | None = None) -> dict[int, SampleTaken]:
    sampler.start_many([(r, False, (last or {}).get(r.process.pid)) for r in regs])
    out: dict[int, SampleTaken] = {}
    while len(out) < len(regs):
        got = inbox.get(timeout=60)
        for taken in got.taken if isinstance(got, SampleBatch) else (got,):
            assert isinstance(taken, SampleTaken) and taken.process.pid not in out  # exactly one each
            out[taken.process.pid] = taken
    return out


def _functions(s: Sample) -> set[str]:
    return {name for thread in s.signature for name, _, _ in thread}


def test_one_sampler_serves_many_processes_and_reads_only_those_that_ran(workers: list[subprocess.Popen[str]]) -> None:
    inbox: queue.Queue[object] = queue.Queue()
    quiet = Quiet(every=0.2)
    sampler = Sampler(10.0, 4.0, UserLimits(100, 4.0), inbox.put, quiet=quiet)
    sampler.start_quiet()
    try:
        regs = [_reg(p) for p in workers]
        first = _round(sampler, inbox, regs)
        for i, r in enumerate(regs):  # each process's own stack, read by py-spy
            s = first[r.process.pid].sample
            assert s.error is None and s.read and f"wait_w{i}" in _functions(s), s
        assert sampler.reads == len(regs)

        # Two of them move on to their next function; the others stand still.
        for p in workers[:2]:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
            _ready(p)
        time.sleep(0.5)
        second = _round(sampler, inbox, regs, {pid: t.sample for pid, t in first.items()})
        for i, r in enumerate(regs):
            s = second[r.process.pid].sample
            assert s.error is None
            if i < 2:  # they ran: read again, and the new stack is theirs
                assert s.read and f"then_w{i}" in _functions(s) and f"wait_w{i}" not in _functions(s)
            else:  # nothing of theirs ran: the same stack, carried, no py-spy
                assert not s.read and s.signature == first[r.process.pid].sample.signature
                assert s.time > first[r.process.pid].sample.time and s.activity is not None
        assert sampler.reads == len(regs) + 2 and sampler.carried == len(regs) - 2

        # The two that moved now wait in their new function; the quiet look saw them stop. Read once
        # more (their last sample was read while their threads were still settling, or not: either
        # way), a stack read now is known to have held since a quiet look before the read.
        time.sleep(0.8)
        third = _round(sampler, inbox, regs[:2])
        for r in regs[:2]:
            s = third[r.process.pid].sample
            assert s.read and s.since is not None and s.since < s.time - 0.3, (s.since, s.time)
    finally:
        sampler.shutdown()


def test_a_users_py_spy_budget_is_spent_by_reads_alone(budgeted: list[subprocess.Popen[str]]) -> None:
    """One py-spy run a second for this uid, with a bucket of one: six processes' first reads are
    mostly deferred; once read, carried samples go on with the budget spent."""
    inbox: queue.Queue[object] = queue.Queue()
    sampler = Sampler(10.0, 0.5, UserLimits(100, 0.5, burst_seconds=2.0), inbox.put)
    try:
        regs = [_reg(p) for p in budgeted]
        first = _round(sampler, inbox, regs)
        read = {pid: t.sample for pid, t in first.items() if t.deferred is None}
        deferred = [t for t in first.values() if t.deferred is not None]
        assert len(read) == 1 and len(deferred) == len(regs) - 1 and all(s.error is None for s in read.values())
        assert all(t.deferred > time.monotonic() for t in deferred)  # type: ignore[operator]
        again = _round(sampler, inbox, [r for r in regs if r.process.pid in read], read)
        (taken,) = again.values()
        assert taken.deferred is None and not taken.sample.read  # carried: no budget needed
    finally:
        sampler.shutdown()
