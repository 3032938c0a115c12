"""A process's life in the daemon: one hang is one incident, however long it lasts; a hang is
captured as a transaction (never left hung without an incident); every capture step's bug is a
failed step; the status file says which timeout applies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest
import structlog

from hangwatchd.capture.base import Phase, Step
from hangwatchd.host.deadline import Deadline
from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv
from tests.s3server import S3Server

from .conftest import hangwatchd

HELD = 60.0  # seconds each hang is kept after it was first declared

DEADLOCK = """
import threading
a = threading.Lock()
a.acquire()
def frozen_on_a_lock():
    a.acquire()
frozen_on_a_lock()
"""

SLEEP_LOOP = """
import time
def waiting_in_a_loop():
    while True:
        time.sleep(0.2)
waiting_in_a_loop()
"""


def _events(d: ScratchDaemon, name: str, pid: int | None = None) -> list[dict]:
    return [e for e in d.logs() if e.get("event") == name and (pid is None or e.get("pid") == pid
                                                                or pid in (e.get("pids") or []))]


def _samples_seen(d: ScratchDaemon) -> float:
    """Stack samples taken, plain and native: every series (a first sample that failed, taken as the
    process started, makes a series of its own that never grows)."""
    return d.metric_total("hangwatchd_stack_samples_total", outcome="ok")


def test_three_hangs_held_for_a_minute_are_each_declared_exactly_once(tmp_path: Path) -> None:
    """A never-instrumented process frozen on a lock, a process whose beats stop, and one asleep in
    a loop under a declared stack timeout: each hang is held for a minute while the daemon keeps
    sampling (the native confirming look included), and each is declared hung once."""
    config = {"stack_interval": 1.0, "gpu_dump": "never", "capture_timeout": 20.0}
    with ScratchDaemon(tmp_path, config=config) as d:
        procs = [
            d.run([sys.executable, "-c", DEADLOCK], "--stack-timeout", "3", start_new_session=True),
            d.run(workload_argv(beats=30, interval=0.05), "--heartbeat-timeout", "2", start_new_session=True),
            d.run([sys.executable, "-c", SLEEP_LOOP], "--stack-timeout", "3", start_new_session=True),
        ]
        try:
            status = wait_for(lambda: _status_of(d, 3), 20, "three processes watched")
            workloads = [p["pid"] for p in status]
            assert len(workloads) == 3
            # TIMEOUT says which timeout decides each one's hang, and where it comes from.
            assert sorted(tuple(p["applied_timeout"]) for p in status) == [
                (2.0, "heartbeat, registration"), (3.0, "stack, registration"), (3.0, "stack, registration")]
            table = hangwatchd("status", "--runtime-dir", str(d.runtime_dir)).stdout
            assert table.count("3s (stack, registration)") == 2 and "2s (heartbeat, registration)" in table
            # Each is declared hung once, and stored.
            wait_for(lambda: all(_events(d, "incident_stored", pid) for pid in workloads), 60, "an incident for each")
            first = time.monotonic()
            # Held: the daemon keeps looking at each (stack samples go on) for a minute.
            before = _samples_seen(d)
            wait_for(lambda: time.monotonic() - first >= HELD and _samples_seen(d) >= before + 60, HELD + 60,
                     "a minute of sampling", every=1.0)
            for pid in workloads:
                hung = _events(d, "process_hung", pid)
                assert len(hung) == 1, f"pid {pid} declared hung {len(hung)} times: {hung}"
                assert not _events(d, "process_recovered", pid)
            assert len(_events(d, "incident_stored")) == 3
            assert {p["state"] for p in _status_of(d, 3) or []} == {"captured"}
            # The incident says truthfully how long the stack held still, over how many samples.
            for inc in d.store().list():
                if inc["reason"] == "stack":
                    detail = json.loads((Path(inc["dir"]) / "incident.json").read_text())["detail"]
                    held = float(detail.split("the same stack for ")[1].split(" s")[0])
                    samples = int(detail.split("; ")[1].split(" samples")[0])
                    # Two samples at least: a read after the freeze knows since when the stack held
                    # (the quiet look), so two can span the window.
                    assert held >= 3 and samples >= 2, detail
        finally:
            for p in procs:
                stop(p, sig=signal.SIGKILL, group=True)


def _status_of(d: ScratchDaemon, n: int) -> list[dict] | None:
    out = hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout
    procs = [p for p in json.loads(out)["processes"] if p["role"] != "launcher"] if out else []
    return procs if len(procs) >= n else None


def gpu_workload(*args: str) -> list[str]:
    return [sys.executable, "-m", "hangwatchd.testing", "gpu-workload", *args]


class _Broken:
    """A capture step with a bug: what a user-shaped input (``TORCH_FR_DUMP_TEMP_FILE=/tmp/fr**``
    made ``Path.glob`` raise ValueError in the flight recorder step) looks like to the pipeline."""

    name = "broken"
    phase: ClassVar[Phase] = Phase.FIRST

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def run(self, target: object, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        raise self.exc


def test_a_bug_in_one_step_fails_that_step_only_and_no_draft_is_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever a step raises is that step's failure (its traceback in the JSON log); the other
    steps run and the incident is stored. Whatever stops a capture half way leaves no draft."""
    from hangwatchd import log
    from hangwatchd.capture import ProcStep
    from hangwatchd.daemon.make_incident import make_incident
    from hangwatchd.host import procfs
    from hangwatchd.incidents.store import Store
    from hangwatchd.model import Registration, Suspicion

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = wait_for(lambda: procfs.identify(victim.pid), 5, "the victim")
        target = Registration(process=me, uid=os.getuid(), cmdline=("python",))
        store = Store(tmp_path / "state")
        store.open()
        why = Suspicion("heartbeat", "no beat for 3 s", time.time())
        log.configure("json", "info")
        steps: list[tuple[Step, float]] = [(_Broken(ValueError("Invalid pattern: '**' can only be an entire path component")), 5.0), (ProcStep(), 5.0)]
        incident_id = make_incident(store, steps, [target], why, Deadline.after(30.0))
        (inc,) = store.list()
        assert inc["id"] == incident_id and inc["complete"]
        results = {r["step"]: r for r in json.loads((Path(inc["dir"]) / "incident.json").read_text())["processes"][0]["steps"]}
        assert not results["broken"]["ok"] and results["broken"]["error"].startswith("ValueError: Invalid pattern")
        assert results["proc"]["ok"]
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
        (raised,) = [e for e in lines if e.get("event") == "capture_step_raised"]
        exc = raised["exception"][0]  # structlog's dict traceback, not "exc_info": true
        assert exc["exc_type"] == "ValueError" and any(f["name"] == "run" for f in exc["frames"])

        # Something no step may swallow (the daemon stopping) ends the capture: no draft stays.
        with pytest.raises(SystemExit):
            make_incident(store, [(_Broken(SystemExit(1)), 5.0)], [target], why, Deadline.after(30.0))
        assert [p.name for p in store.dir.iterdir() if p.name.startswith(".partial")] == []
        assert len(store.list()) == 1
    finally:
        stop(victim, sig=signal.SIGKILL)
        structlog.reset_defaults()  # the configuration held capsys's stream, closed after this test


def test_subproc_never_waits_without_limit_for_a_killed_tool(tmp_path: Path) -> None:
    """A tool whose grandchild escapes its process group keeps the pipes open: past the deadline
    the tool is killed and the call returns, without waiting for the grandchild."""
    from hangwatchd.host import subproc

    pidfile = tmp_path / "grandchild.pid"
    script = (f"import os, subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
              f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
              f"time.sleep(120)\n")
    try:
        res = subproc.run([sys.executable, "-c", script], timeout=2.0)
        assert res.timed_out and res.seconds < 2.0 + 2 * subproc.REAP_WAIT + 1
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs for the state dir needs root (CI runs as root)")
def test_a_hang_is_captured_when_the_fleet_cannot_be_told_for_a_full_state_dir(tmp_path: Path) -> None:
    """With ``store`` set and the state dir full, telling the fleet fails (its outbox lives in the
    state dir): the hang is still captured (its report kept in the spool), never left hung."""
    from tests.s3server import S3Server
    from tests.test_faults import fill

    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(state)], check=True)
    server = S3Server().start()
    try:
        d = ScratchDaemon(tmp_path / "d", "--state-dir", str(state), "--store", server.url(), "--node-name", "n1",
                   env=server.env, config={"gpu_dump": "never", "pyspy_native": False})
        work = None
        try:
            filler = fill(state)
            work = d.run(workload_argv(beats=5, interval=0.02), "--job", "j1", "--heartbeat-timeout", "1")
            wait_for(lambda: _events(d, "incident_pending"), 60, "the report kept while the state dir is full")
            (failed,) = _events(d, "job_declare_failed")
            assert failed["exception"][0]["exc_type"] == "OSError" or "No space" in failed["error"], failed
            # status.json is written off the loop, at most once a second
            (proc,) = wait_for(lambda: [p for p in _status_of(d, 1) or [] if p["state"] == "captured"], 5, "captured")
            assert proc["incident"] == _events(d, "incident_pending")[0]["incident"]
            assert len(_events(d, "process_hung")) == 1
            filler.unlink()
        finally:
            if work is not None:
                stop(work, sig=signal.SIGKILL)
            d.stop()
    finally:
        server.stop()
        subprocess.run(["umount", "-l", str(state)])


def test_only_the_transition_writes_a_process_life() -> None:
    """Nothing but Watchlist.change writes a process's state, suspicion, timers or progress mark."""
    from hangwatchd.metrics import create
    from hangwatchd.model import ProcessId, Registration, State
    from hangwatchd.watch.watched import NotTheOwner, Watched, Watchlist

    reg = Registration(process=ProcessId(os.getpid(), 0), uid=os.getuid(), cmdline=("x",))
    w = Watched(reg, State.HEALTHY, seen_at=0.0, timeout=5.0)
    lst = Watchlist(create(node="t"))
    assert lst.admit(w)
    for name in ("state", "suspicion", "next_check", "next_sample", "confirm_by", "mark", "incident"):
        with pytest.raises(NotTheOwner):
            setattr(w, name, None)
    lst.change(w, State.SUSPECT, confirm_by=3.0, check_at=1.0)
    assert (w.state, w.confirm_by, w.next_check) == (State.SUSPECT, 3.0, 1.0)
    assert lst.counts[State.SUSPECT] == 1 and lst.counts[State.HEALTHY] == 0
    lst.forget(w)
    assert w.process not in lst and sum(lst.counts.values()) == 0


def test_a_capture_running_when_the_daemon_stops_is_finished_logged_and_counted(tmp_path: Path) -> None:
    """SIGTERM while a capture runs (a flight recorder that never answers holds it for its
    timeout): the daemon stops once the capture is done, and that capture is stored, logged as
    ``incident_stored`` and counted like any other."""
    d = ScratchDaemon(tmp_path, config={"gpu_dump": "never", "flight_recorder_timeout": 4.0, "pyspy_native": False})
    work = d.run(gpu_workload("--cuda", "none", "--fr", "silent"), "--heartbeat-timeout", "1")
    try:
        wait_for(lambda: [e for e in d.logs() if e.get("event") == "capture_step" and e.get("step") == "pyspy"], 30,
                 "the capture under way")
        assert not _events(d, "incident_stored")
        assert d.stop() == 0
        (stored,) = _events(d, "incident_stored")
        (inc,) = d.store().list()
        assert stored["incident"] == inc["id"] and inc["complete"]
        stopping = next(i for i, e in enumerate(d.logs()) if e.get("event") == "daemon_stopping")
        assert [e["event"] for e in d.logs()[stopping:]].count("incident_stored") == 1
    finally:
        stop(work, sig=signal.SIGKILL)


def test_an_upload_that_can_never_succeed_does_not_hold_up_the_others(tmp_path: Path) -> None:
    """A job name long enough to push its S3 key past 1,024 bytes: that incident is dropped from
    the outbox (logged, kept on the node), and the incident queued behind it is uploaded."""
    import structlog

    from hangwatchd.fleet.outbox import Outbox, Task
    from hangwatchd.fleet.uploader import Uploader
    from hangwatchd.fleet.url import parse
    from tests.s3server import S3Server

    server = S3Server().start()
    try:
        outbox = Outbox(tmp_path / "outbox", 100)
        outbox.open()
        for i, job in enumerate(("j" * 1100, "short-job")):
            inc = tmp_path / "incidents" / f"inc{i}"
            inc.mkdir(parents=True)
            (inc / "incident.json").write_text(json.dumps({"id": f"inc{i}", "job": job, "processes": []}))
            outbox.put(Task("incident", job, f"ji{i}", incident=f"inc{i}", dir=str(inc), queued=1000.0 + i))
        url = parse(server.url())
        up = Uploader(url, "n1", outbox, server.client, lambda t: t, lambda t: t)
        with structlog.testing.capture_logs() as logs:
            up.drain()
        keys = [o["Key"] for o in server.client().list_objects_v2(Bucket=server.bucket).get("Contents", [])]
        assert any("short-job" in k and k.endswith("inc1.json") for k in keys), keys
        assert outbox.names() == []  # neither waits: one sent, one dropped for good
        (dropped,) = [e for e in logs if e["event"] == "store_upload_dropped"]
        assert "past the store's 1024" in dropped["error"] and dropped["attempts"] == 1
    finally:
        server.stop()


def test_the_ram_spool_keeps_at_most_its_limit_of_reports_the_oldest_dropped(tmp_path: Path) -> None:
    """Reports kept while the state dir is full live in RAM: past MAX_REPORTS the oldest goes."""
    import structlog

    from hangwatchd.incidents import spool as spool_mod

    spool = spool_mod.Spool(tmp_path / "spool")
    ids = []
    with structlog.testing.capture_logs() as logs:
        for i in range(spool_mod.MAX_REPORTS + 2):
            draft = spool.begin("heartbeat", "j", [100 + i], now=1_000_000.0 + i)
            spool.keep(draft, {"id": draft.id, "reason": "heartbeat"}, "s")
            ids.append(draft.id)
    pending = [p.name for p in spool.pending()]
    assert len(pending) == spool_mod.MAX_REPORTS and pending == sorted(ids)[2:]
    assert [e["incident"] for e in logs if e["event"] == "spool_report_dropped"] == sorted(ids)[:2]


def test_the_daemon_is_unhealthy_only_while_a_capture_runs_past_its_own_deadline() -> None:
    """WATCHDOG=1 goes to systemd only while this holds: each capture is measured against its own
    deadline (and a grace for its last step to be killed), never against a fixed timeout."""
    from hangwatchd.daemon.capture_workers import WEDGED_AFTER, CaptureWorkers, _Capture
    from hangwatchd.model import Suspicion

    workers = object.__new__(CaptureWorkers)  # only the captures in flight matter here
    why = Suspicion("heartbeat", "no beat", time.time())
    now = time.monotonic()
    long_one = _Capture([], [], why, now - 500, Deadline(now + 100), id=1)  # running 500 s, within its deadline
    workers.captures = {1: long_one}
    assert workers.healthy(now)
    late = _Capture([], [], why, now - 20, Deadline(now - 1), id=2)  # 1 s past its deadline: being cut
    workers.captures = {1: long_one, 2: late}
    assert workers.healthy(now) and workers.healthy(now + WEDGED_AFTER - 2)
    assert not workers.healthy(now + WEDGED_AFTER)  # wedged: the daemon stops telling systemd it is well
    workers.captures = {1: long_one}  # its CaptureDone came back
    assert workers.healthy(now + WEDGED_AFTER)


@pytest.mark.parametrize("owners", ["one", "two"])
def test_each_capture_request_reaches_the_loop_once_as_a_value(s3: S3Server, tmp_path: Path, owners: str) -> None:
    """Other nodes' capture requests go to the loop's queue as values, each once (the poller reads
    an object again only when it changed), in the order they were written. A job is (owner,
    name): two users' jobs of one name are two jobs, and one's request never takes the other's place."""
    from hangwatchd.fleet.agent import Agent, CaptureRequest

    client = s3.client()
    if s3.bucket not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=s3.bucket)
    env = dict(os.environ)
    os.environ.update(s3.env)
    posted: list[object] = []
    agent = Agent(s3.url(), "n1", tmp_path, 0.05, 300.0, 10, post=posted.append)
    jobs = [(1000, "j"), (1000, "k")] if owners == "one" else [(1000, "j"), (1001, "j")]
    try:
        agent.jobs = frozenset(jobs)
        agent.start()
        for (uid, job), n in [(jobs[0], 1), (jobs[0], 2), (jobs[1], 1), (jobs[0], 3)]:
            before = agent.polls
            body = {"job": job, "job_incident": f"{job}-{uid}-{n}", "node": "n2", "time": time.time(),
                    "reason": "heartbeat", "uid": uid}
            client.put_object(Bucket=s3.bucket, Key=f"hw/requests/{job}/latest-u{uid}.json", Body=json.dumps(body).encode())
            wait_for(lambda before=before: agent.polls >= before + 4, 20, "the poller read it")  # type: ignore[misc]  # a default binds the loop's value
        assert all(isinstance(r, CaptureRequest) for r in posted)
        assert [(r.uid, r.job_incident) for r in posted if isinstance(r, CaptureRequest)] == [
            (jobs[0][0], f"{jobs[0][1]}-{jobs[0][0]}-1"), (jobs[0][0], f"{jobs[0][1]}-{jobs[0][0]}-2"),
            (jobs[1][0], f"{jobs[1][1]}-{jobs[1][0]}-1"), (jobs[0][0], f"{jobs[0][1]}-{jobs[0][0]}-3")]
    finally:
        agent.stop()
        os.environ.clear()
        os.environ.update(env)
