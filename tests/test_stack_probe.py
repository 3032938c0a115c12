"""The stack probe: a long-lived reader that tells, without a py-spy run, whether a process whose
threads ran has moved its Python frames or locals. Real processes, real pystack, real py-spy: the
probe's "same" agrees with two py-spy reads; a woken process that did not move is carried, one
that moved is read; a helper that does not answer is killed at the deadline and started again;
where the probe cannot read, py-spy reads everything; a poll loop that never ends is declared
hung from samples the probe carried."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatchd.detect.sampler import Sampler
from hangwatchd.detect.stack import take_sample
from hangwatchd.detect.stack_probe import Probed, StackProbe
from hangwatchd.host import procfs
from hangwatchd.host.pyspy_binary import find_pyspy
from hangwatchd.host.user_limits import UserLimits
from hangwatchd.model import Registration
from hangwatchd.testing import ScratchDaemon, stop, wait_for
from hangwatchd.watch.stack_history import Sample

from .detect.test_sampler import _reg
from .detect.test_sampler import _round as sampler_round

pytestmark = pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")

# Wakes every 0.2 s (its thread runs between any two samples) and goes back to the same line
# with the same locals: its Python state does not move.
STILL = """
import time
def poll(flag):
    print('ready', flush=True)
    while True:
        time.sleep(0.2)
poll('never')
"""

# Wakes as often, and counts: a local variable moves every time.
MOVING = """
import time
def count():
    print('ready', flush=True)
    n = 0
    while True:
        n += 1
        time.sleep(0.2)
count()
"""


def _spawn(code: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def pair() -> Iterator[tuple[subprocess.Popen[str], subprocess.Popen[str]]]:
    still, moving = _spawn(STILL), _spawn(MOVING)
    time.sleep(0.3)
    try:
        yield still, moving
    finally:
        stop(still, moving, sig=signal.SIGKILL, group=True)


def _pyspy(pid: int) -> Sample:
    s = take_sample(pid, 10.0)
    assert s.error is None, s.error
    return s


def _at_rest(probe: StackProbe, pid: int) -> Probed:
    """The probe's reading of ``pid`` taken while none of its threads ran (it wakes for a moment
    every 0.2 s: a reading that overlaps a wake says so, and is taken again)."""
    for _ in range(20):
        got = probe.probe(pid, time.monotonic() + 10)
        assert got is not None
        if not got.running:
            return got
        time.sleep(0.03)
    raise AssertionError(f"pid {pid} was never read at rest")


def test_the_probe_says_same_where_two_py_spy_reads_do(pair: tuple[subprocess.Popen[str], subprocess.Popen[str]]) -> None:
    probe = StackProbe()
    try:
        seen = {}
        for p in pair:
            a, first = _at_rest(probe, p.pid), _pyspy(p.pid)
            time.sleep(0.5)
            b, second = _at_rest(probe, p.pid), _pyspy(p.pid)
            same_by_pyspy = (first.signature, first.locals_digest) == (second.signature, second.locals_digest)
            assert (a.state == b.state) == same_by_pyspy, (p.pid, a, b)
            seen[p.pid] = a.state == b.state
        still, moving = pair
        assert seen == {still.pid: True, moving.pid: False}  # and each was what it was written to be
        assert probe.probe(2**22 + 1, time.monotonic() + 10) is None  # no such process: no digest, no harm
        assert probe.failures == 0 and probe.unavailable is None
    finally:
        probe.close()


def _round(sampler: Sampler, inbox: queue.Queue[object], regs: list[Registration],
           last: dict[int, Sample] | None = None) -> dict[int, Sample]:
    return {pid: taken.sample for pid, taken in sampler_round(sampler, inbox, regs, last).items()}


def test_a_woken_process_that_did_not_move_is_carried_and_one_that_moved_is_read(
        pair: tuple[subprocess.Popen[str], subprocess.Popen[str]]) -> None:
    inbox: queue.Queue[object] = queue.Queue()
    sampler = Sampler(10.0, 100.0, UserLimits(100, 100.0), inbox.put)
    still, moving = pair
    try:
        regs = [_reg(still), _reg(moving)]
        first = _round(sampler, inbox, regs)
        assert all(s.read and s.error is None for s in first.values()) and sampler.reads == 2
        samples, digests, carried = first, {first[moving.pid].locals_digest}, []
        for _ in range(4):
            time.sleep(0.5)  # both ran in between: neither can be carried for not having run
            samples = _round(sampler, inbox, regs, samples)
            still_now, read = samples[still.pid], samples[moving.pid]
            assert still_now.signature == first[still.pid].signature and still_now.error is None
            if still_now.probed:  # carried on the probe's word (a probe that overlapped a wake: read again)
                assert not still_now.read and still_now.activity is not None
                assert still_now.activity.ran != first[still.pid].activity.ran  # type: ignore[union-attr]
                carried.append(still_now)
            assert read.read and not read.probed and read.locals_digest not in digests  # every time a new count
            digests.add(read.locals_digest)
        assert len(carried) >= 2, "the still process was carried on the probe's word in fewer than 2 of 4 rounds"
        assert sampler.reads == 2 + 4 + (4 - len(carried))  # py-spy ran for the one that moved, every time
        assert "poll" in {name for thread in carried[-1].signature for name, _, _ in thread}  # py-spy's frames, carried
    finally:
        sampler.shutdown()


SILENT = "import sys; print('{\"ready\": true}', flush=True); sys.stdin.readline(); import time; time.sleep(600)"


def test_a_helper_that_does_not_answer_is_killed_at_the_deadline_and_started_again(
        pair: tuple[subprocess.Popen[str], subprocess.Popen[str]]) -> None:
    probe = StackProbe([sys.executable, "-c", SILENT])
    try:
        started = time.monotonic()
        assert probe.probe(pair[0].pid, started + 1.0) is None
        assert 1.0 <= time.monotonic() - started < 4.0 and probe.failures == 1
        helpers = _helpers()
        assert not helpers, f"the silent helper outlived its deadline: {helpers}"
        assert probe.probe(pair[0].pid, time.monotonic() + 0.5) is None and probe.failures == 2  # started again
    finally:
        probe.close()
    assert not _helpers()


def _helpers() -> list[int]:
    """Live processes running the silent helper (zombies are gone for this purpose)."""
    out = []
    for pid in (int(n) for n in os.listdir("/proc") if n.isdigit()):
        try:
            if "time.sleep(600)" in Path(f"/proc/{pid}/cmdline").read_text() and procfs.state(pid) != "Z":
                out.append(pid)
        except OSError:
            continue
    return out


def test_where_the_probe_cannot_read_py_spy_reads_every_sample(pair: tuple[subprocess.Popen[str], subprocess.Popen[str]]) -> None:
    inbox: queue.Queue[object] = queue.Queue()
    gone = StackProbe([sys.executable, "-c", "print('{\"error\": \"pystack is not installed\"}', flush=True)"])
    sampler = Sampler(10.0, 100.0, UserLimits(100, 100.0), inbox.put, probe=gone)
    try:
        regs = [_reg(p) for p in pair]
        samples = _round(sampler, inbox, regs)
        time.sleep(0.3)
        samples = _round(sampler, inbox, regs, samples)
        assert all(s.read and not s.probed and s.error is None for s in samples.values())
        assert sampler.reads == 4 and gone.unavailable == "pystack is not installed"
    finally:
        sampler.shutdown()


def test_a_poll_loop_that_never_ends_is_declared_hung_from_samples_the_probe_carried(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config={"stack_interval": 1.0, "gpu_dump": "never"}) as d:
        work = d.run([sys.executable, "-c", STILL], "--stack-timeout", "4", stdout=subprocess.PIPE, start_new_session=True)
        try:
            hung = d.event("process_hung", 60)
            suspect = next(e for e in d.logs() if e.get("event") == "process_suspect" and e.get("pid") == hung["pid"])
            assert "the probe read the same frames and locals" in suspect["detail"], suspect
            assert d.metric_total("hangwatchd_stack_samples_carried_total", why="probe") >= 2
            inc = wait_for(lambda: d.store().list(), 60, "the incident")[0]
            stacks = json.loads((Path(inc["dir"]) / str(hung["pid"]) / "pyspy.json").read_text())
            assert any(f.get("name") == "poll" for t in stacks for f in t.get("frames") or [])
        finally:
            stop(work, sig=signal.SIGKILL, group=True)


THREADED = """
import threading, time
for _ in range(3):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
def poll(flag):
    print('ready', flush=True)
    while True:
        time.sleep(0.05)
poll('never')
"""


def test_a_process_of_many_threads_is_read_by_py_spy_alone() -> None:
    """pystack's read grows by some 4 ms a thread: a process of four, woken but unmoved, is read by
    py-spy as before the probe, never probed."""
    inbox: queue.Queue[object] = queue.Queue()
    probe = StackProbe()
    sampler = Sampler(10.0, 100.0, UserLimits(100, 100.0), inbox.put, probe=probe)
    threaded = _spawn(THREADED)
    try:
        regs = [_reg(threaded)]
        samples = _round(sampler, inbox, regs)
        time.sleep(0.3)
        (again,) = _round(sampler, inbox, regs, samples).values()
        assert again.read and not again.probed and again.activity is not None and again.activity.threads == 4
        assert probe.probes == 0 and sampler.reads == 2
    finally:
        sampler.shutdown()
        stop(threaded, sig=signal.SIGKILL, group=True)


# Computes Python without a pause; its counter moves all the time. pystack reads a running frame's
# locals from its value stack half the time (the counter as the same stale int, read after read).
COMPUTING = """
import hashlib
def tokenize():
    print('ready', flush=True)
    n = 0
    while True:
        n += hashlib.sha256(str(n).encode()).digest()[0]
tokenize()
"""


def test_a_process_that_computes_is_never_carried_on_the_probes_word() -> None:
    inbox: queue.Queue[object] = queue.Queue()
    sampler = Sampler(10.0, 100.0, UserLimits(100, 100.0), inbox.put)
    busy = _spawn(COMPUTING)
    try:
        regs = [_reg(busy)]
        samples = _round(sampler, inbox, regs)
        for _ in range(5):
            time.sleep(0.3)
            samples = _round(sampler, inbox, regs, samples)
            (s,) = samples.values()
            assert s.read and not s.probed and s.error is None, s
        assert sampler.reads == 6
    finally:
        sampler.shutdown()
        stop(busy, sig=signal.SIGKILL, group=True)
