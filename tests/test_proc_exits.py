"""Process exits recorded as they happen, from the kernel's own process events: real processes,
real signals, the real proc connector; and the exits step that files them in an incident."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.capture import StepNotApplicable
from hangwatchd.capture.exits import ExitsStep
from hangwatchd.host import procfs
from hangwatchd.host.deadline import Deadline
from hangwatchd.host.proc_exits import ProcExits
from hangwatchd.model import Registration

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the kernel's process events are root's alone")


@pytest.fixture
def listener() -> Iterator[ProcExits]:
    if os.geteuid() != 0:
        pytest.skip("the kernel's process events are root's alone")
    pe = ProcExits()
    assert pe.start(), pe.off
    yield pe
    pe.stop()


def family(body: Callable[[], None]) -> int:
    """Fork a process that runs ``body`` (which makes its own children) and exits 0; its pid, reaped."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return pid


def child(then: Callable[[], object]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            then()
        finally:
            os._exit(0)
    return pid


def settled(pe: ProcExits, pid: int, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The exits below ``pid`` once there are ``n`` of them (events arrive a moment after the exit)."""
    end = time.monotonic() + timeout
    while True:
        found = pe.exits_below(pid, 0)
        if len(found) >= n or time.monotonic() > end:
            return found
        time.sleep(0.02)


def test_a_killed_child_and_one_that_exited_with_a_status_are_told_apart(listener: ProcExits) -> None:
    me = os.getpid()
    killed = child(lambda: time.sleep(60))
    three = child(lambda: os._exit(3))
    os.waitpid(three, 0)
    os.kill(killed, signal.SIGKILL)
    os.waitpid(killed, 0)
    found = {e["pid"]: e for e in settled(listener, me, 2)}
    assert found[killed]["signal"] == "SIGKILL" and found[killed]["exit_code"] is None
    assert found[killed]["core_dumped"] is False and found[killed]["ppid"] == me and found[killed]["depth"] == 1
    assert found[three]["exit_code"] == 3 and found[three]["signal"] is None
    assert found[three]["comm"] == procfs.read_capped(f"/proc/{me}/comm", 64).decode().strip()
    assert found[three]["uid"] == 0 and abs(float(found[three]["time"]) - time.time()) < 10


def test_a_grandchild_counts_for_its_grandparent_even_after_its_parent_is_gone(listener: ProcExits) -> None:
    """The parent exits first; the grandchild, reparented (to a subreaper or init), still counts
    for the process that forked its parent."""
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()

    def parent() -> None:
        g = child(lambda: (os.read(go_r, 1), os._exit(7)))
        os.write(said_w, f"{g}\n".encode())

    mid = family(parent)
    with os.fdopen(said_r) as said:
        grandchild = int(said.readline())
    os.write(go_w, b"x")  # the grandchild's turn to end
    found = {e["pid"]: e for e in settled(listener, os.getpid(), 2)}
    for fd in (said_w, go_r, go_w):
        os.close(fd)
    assert found[mid]["depth"] == 1 and found[grandchild]["depth"] == 2
    assert found[grandchild]["exit_code"] == 7 and found[grandchild]["ppid"] == mid
    assert listener.exits_below(mid, 0) == []  # mid is gone: nobody to ask about


def test_a_subreapers_adopted_child_stays_its_original_parents() -> None:
    """A process that is its children's subreaper adopts a grandchild whose parent ended; the
    grandchild's exit still counts for the parent that forked it, and for those above."""
    if os.geteuid() != 0:
        pytest.skip("the kernel's process events are root's alone")
    pe = ProcExits()
    assert pe.start(), pe.off
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        def reaper() -> None:
            ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

            def middle() -> None:
                g = child(lambda: (os.read(go_r, 1), os._exit(9)))
                os.write(said_w, f"{os.getpid()} {g}\n".encode())

            os.waitpid(child(middle), 0)
            os.write(said_w, b"adopted\n")
            os.waitpid(-1, 0)  # the adopted grandchild

        top = child(reaper)
        with os.fdopen(said_r) as said:
            mid, g = map(int, said.readline().split())
            assert said.readline().strip() == "adopted"
        assert procfs.parent(g) == top
        os.write(go_w, b"x")
        os.waitpid(top, 0)
        below_me = {e["pid"]: e for e in settled(pe, os.getpid(), 3)}
        assert below_me[g]["ppid"] == mid and below_me[g]["depth"] == 3 and below_me[g]["exit_code"] == 9
        assert below_me[mid]["depth"] == 2 and below_me[top]["depth"] == 1
    finally:
        pe.stop()
        for fd in (said_w, go_r, go_w):
            os.close(fd)


def test_only_exits_within_the_window_are_given(listener: ProcExits) -> None:
    early = child(lambda: os._exit(1))
    os.waitpid(early, 0)
    settled(listener, os.getpid(), 1)
    time.sleep(0.05)
    since = time.time()
    late = child(lambda: os._exit(2))
    os.waitpid(late, 0)
    settled(listener, os.getpid(), 2)
    assert [e["pid"] for e in listener.exits_below(os.getpid(), since)] == [late]


def test_the_ring_keeps_only_the_newest_exits() -> None:
    if os.geteuid() != 0:
        pytest.skip("the kernel's process events are root's alone")
    pe = ProcExits(capacity=20)
    assert pe.start(), pe.off
    try:
        pids = []
        for _i in range(40):
            p = child(lambda: os._exit(0))
            os.waitpid(p, 0)
            pids.append(p)
        end = time.monotonic() + 5
        while pids[-1] not in [e["pid"] for e in pe.exits_below(os.getpid(), 0)] and time.monotonic() < end:
            time.sleep(0.02)
        assert len(pe) == 20  # the node's other exits count too: the newest 20 of all
        mine = [e["pid"] for e in pe.exits_below(os.getpid(), 0)]
        assert mine and mine == pids[-len(mine):] and pids[0] not in mine
    finally:
        pe.stop()


def test_threads_are_not_processes(listener: ProcExits) -> None:
    import threading

    def with_threads() -> None:
        ts = [threading.Thread(target=time.sleep, args=(0.01,)) for _ in range(5)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    p = family(with_threads)
    time.sleep(0.2)
    assert [e["pid"] for e in settled(listener, os.getpid(), 1)] == [p]


def test_off_as_an_ordinary_user_with_the_reason() -> None:
    if os.geteuid() != 0:
        pe = ProcExits()
        assert not pe.start() and pe.off and "root" in pe.off
        return
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            pe = ProcExits()
            started = pe.start()
            os.write(w, f"{started}|{pe.off}".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    ok, why = os.read(r, 4096).decode().split("|", 1)
    os.close(r)
    assert ok == "False"
    assert why == "process exits are recorded only when the daemon runs as root (it runs as uid 65534)", why


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) to make a PID namespace")
def test_off_in_a_containers_own_pid_namespace_with_the_reason() -> None:
    code = "from hangwatchd.host.proc_exits import ProcExits; pe = ProcExits(); print(pe.start(), pe.off, sep='|')"
    res = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    ok, why = res.stdout.strip().splitlines()[-1].split("|", 1)
    assert ok == "False" and "never answered" in why and "namespace" in why, res.stdout + res.stderr
    assert "process_exits_off" in res.stdout + res.stderr  # the one line in the log


# -- the capture step ---------------------------------------------------------------------


def test_the_exits_step_files_the_killed_worker_of_a_hung_parent(listener: ProcExits, tmp_path: Path) -> None:
    me = procfs.identify(os.getpid())
    assert me is not None
    worker = child(lambda: time.sleep(60))
    os.kill(worker, signal.SIGKILL)
    os.waitpid(worker, 0)
    settled(listener, me.pid, 1)
    step = ExitsStep(listener=listener, window=60.0)
    assert step.run(Registration(process=me, uid=0), tmp_path, Deadline.after(2.0)) == ("exits.json",)
    data = json.loads((tmp_path / "exits.json").read_text())
    assert data["pid"] == me.pid and data["window_s"] == 60.0 and data["not_shown"] == 0 and data["lost"] == 0
    assert [(e["pid"], e["signal"], e["depth"]) for e in data["exits"]] == [(worker, "SIGKILL", 1)]


def test_another_users_process_below_is_counted_not_shown(listener: ProcExits, tmp_path: Path) -> None:
    def as_nobody() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        os._exit(4)

    me = procfs.identify(os.getpid())
    assert me is not None
    mine = child(lambda: os._exit(3))
    theirs = child(as_nobody)
    for p in (mine, theirs):
        os.waitpid(p, 0)
    settled(listener, me.pid, 2)
    ExitsStep(listener=listener).run(Registration(process=me, uid=65534), tmp_path, Deadline.after(2.0))
    data = json.loads((tmp_path / "exits.json").read_text())
    assert [(e["pid"], e["exit_code"], e["uid"]) for e in data["exits"]] == [(theirs, 4, 65534)]
    assert data["not_shown"] == 1


def test_the_exits_step_is_not_applicable_without_a_listener(tmp_path: Path) -> None:
    me = procfs.identify(os.getpid())
    assert me is not None
    with pytest.raises(StepNotApplicable, match="only the daemon runs one"):
        ExitsStep().run(Registration(process=me, uid=0), tmp_path, Deadline.after(1.0))
    off = ProcExits(listen=False)
    assert off.start() is False
    with pytest.raises(StepNotApplicable, match="not recorded here: the exits step is not among capture_steps"):
        ExitsStep(listener=off).run(Registration(process=me, uid=0), tmp_path, Deadline.after(1.0))
    assert not (tmp_path / "exits.json").exists()


def test_a_pool_worker_killed_while_its_parent_waits_in_map_is_in_the_parents_capture(listener: ProcExits, tmp_path: Path) -> None:
    """The case the step exists for: multiprocessing.Pool replaces a SIGKILLed worker and map()
    waits for its task for ever. The parent's capture names the dead worker and its signal."""
    code = textwrap.dedent("""
        import multiprocessing as mp, os, sys, time
        def work(i):
            if i == 0:
                print("worker", os.getpid(), flush=True)
                time.sleep(600)
            return i
        if __name__ == "__main__":
            with mp.get_context("fork").Pool(2) as pool:
                pool.map(work, range(4), chunksize=1)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline().split()[1])
        os.kill(worker, signal.SIGKILL)
        me = procfs.identify(parent.pid)
        assert me is not None
        found: list[dict[str, object]] = []
        end = time.monotonic() + 10
        while not found and time.monotonic() < end:
            found = [e for e in listener.exits_below(parent.pid, 0) if e["pid"] == worker]
            time.sleep(0.05)
        ExitsStep(listener=listener).run(Registration(process=me, uid=0), tmp_path, Deadline.after(2.0))
        data = json.loads((tmp_path / "exits.json").read_text())
        (dead,) = [e for e in data["exits"] if e["pid"] == worker]
        assert (dead["signal"], dead["exit_code"], dead["ppid"], dead["depth"]) == ("SIGKILL", None, parent.pid, 1)
        assert procfs.alive(me)  # and the parent still waits: the pool never gives up on the task
    finally:
        parent.kill()
        parent.wait()
