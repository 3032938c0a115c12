"""Who goes with a hang: one rule (``model.is_job_mate``: the owner's uid and the job's name), and
each caller held to it with two users running a job of the same name."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from hangwatchd.daemon.act import Acting
from hangwatchd.daemon.capture_workers import CaptureWorkers
from hangwatchd.fleet.agent import CaptureRequest
from hangwatchd.host import procfs
from hangwatchd.metrics import create
from hangwatchd.model import ProcessId, Registration, is_job_mate
from hangwatchd.workload import exits

from .conftest import ME, OTHER, Node


def reg(pid: int, uid: int, job: str | None = "train", role: str = "workload") -> Registration:
    return Registration(ProcessId(pid, 1), uid=uid, job=job, role=role)


def test_the_rule() -> None:
    a = reg(1, ME)
    assert is_job_mate(a, reg(2, ME)) and is_job_mate(a, a)
    assert not is_job_mate(a, reg(3, OTHER))  # another user's job of the same name
    assert not is_job_mate(a, reg(4, ME, job="eval"))
    assert not is_job_mate(a, reg(5, ME, role="launcher")) and not is_job_mate(a, reg(6, ME), role="launcher")
    assert not is_job_mate(reg(7, ME, job=None), reg(8, ME, job=None))  # no job: nobody's mate


def test_a_declaration_takes_its_own_users_ranks(node: Node) -> None:
    mine, mate, theirs = node.add(uid=ME, rank=0), node.add(uid=ME, rank=1), node.add(uid=OTHER, rank=1)
    d = node.declare(mine, 0.0)
    assert [w.process for w in d.group] == [mine.process, mate.process] and theirs.process not in [w.process for w in d.group]


def test_a_store_request_takes_its_own_users_ranks(node: Node) -> None:
    mine, theirs = node.add(uid=ME), node.add(uid=OTHER)

    class Fleet:
        def accept(self, _req: CaptureRequest) -> bool:
            return True

    workers = object.__new__(CaptureWorkers)
    workers.watched, workers.requested = node.watched, {}
    workers.fleet = Fleet()  # type: ignore[assignment]  # a stub: only accept() is asked
    req = CaptureRequest("train", "job-1", "n2", time.time(), "heartbeat", "no beat", "report", uid=ME)
    assert [w.process for w in workers.requested_group(req, 10.0)] == [mine.process]
    req = CaptureRequest("train", "job-2", "n2", time.time(), "heartbeat", "no beat", "report", uid=OTHER)
    assert [w.process for w in workers.requested_group(req, 10.0)] == [theirs.process]


def test_exit_records_join_only_their_own_users_job(tmp_path: Path) -> None:
    gone = exits.Departures(tmp_path, keep=600)
    hung, mine, theirs = reg(1, ME), reg(2, ME), reg(3, OTHER)
    for r in (mine, theirs):
        gone.add(exits.Departed(r, time.time(), None, 0))
    assert [d.registration for d in gone.of_job(hung)] == [mine]
    assert [d.registration for d in gone.of_job(reg(4, OTHER))] == [theirs]


def test_abort_ends_only_the_hung_processs_own_users_ranks(runtime: Path) -> None:
    """on_hang = abort: the incident's processes of another user (a job of the same name) are never signalled."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    acting = Acting(runtime, "abort", 5.0, create(CollectorRegistry(), node="unit"))
    try:
        regs = []
        for p, uid in zip(procs, (ME, ME, OTHER)):
            me = procfs.identify(p.pid)
            assert me is not None
            regs.append(Registration(me, uid=uid, job="train"))
        hung, mate, theirs = regs
        (runtime / "ended").mkdir()
        signalled = acting.after_store([hung, mate, theirs], "inc-1")
        assert sorted(signalled) == sorted([procs[0].pid, procs[1].pid])
        assert procs[0].wait(10) == -signal.SIGABRT and procs[1].wait(10) == -signal.SIGABRT
        assert procs[2].poll() is None
    finally:
        acting.stop()
        for p in procs:
            p.kill()
            p.wait()
