"""Acting after capture: on_hang = "abort" ends a hung job's ranks once its incident is stored; "report" never kills."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatchd.testing import Daemon, stop, wait_for, workload_argv

from .conftest import needs_root
from .s3server import S3Server

TIMEOUT = 1.0
FAST = {"pyspy_native": False, "gpu_dump": "never", "capture_steps": ["proc", "pyspy"]}
# A workload that stops beating and ignores SIGABRT: only SIGKILL ends it.
STUBBORN = """
import signal, threading, time, hangwatchd
signal.signal(signal.SIGABRT, signal.SIG_IGN)
for _ in range(5):
    hangwatchd.beat(); time.sleep(0.05)
print("stopped beating", flush=True)
threading.Event().wait()
"""


def events(d: Daemon, name: str) -> list[dict]:
    return [e for e in d.logs() if e.get("event") == name]


def test_abort_ends_the_hung_job_after_its_incident_is_stored_and_says_which(tmp_path: Path) -> None:
    with Daemon(tmp_path, config=FAST) as d:
        work = d.run(workload_argv(beats=5), "--job", "train", "--heartbeat-timeout", str(TIMEOUT), "--on-hang", "abort",
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert work.stdout is not None and work.stdout.readline().strip() == b"stopped beating"
            hung_at = time.monotonic()
            out, err = work.communicate(timeout=TIMEOUT + 60 + 5)
            over_after = time.monotonic() - hung_at
        finally:
            stop(work)
        (inc,) = d.store().list()
        # The evidence was taken from the live process, before it was ended.
        assert inc["reason"] == "heartbeat" and inc["complete"]
        pyspy = json.loads(next(Path(inc["dir"]).rglob("pyspy.json")).read_text())
        assert "hang_here" in json.dumps(pyspy)
        stored_at = next(e for e in events(d, "incident_stored"))["timestamp"]
        aborted = events(d, "job_aborted")
        assert len(aborted) == 1 and aborted[0]["incident"] == inc["id"] and aborted[0]["timestamp"] >= stored_at
        # Over within timeout + capture + 5 s, ended by SIGABRT (a Python process's default: it dies at once).
        capture_s = float(json.loads((Path(inc["dir"]) / "incident.json").read_text())["time"]) - (time.time() - over_after)
        assert over_after < TIMEOUT + max(capture_s, 0) + 5 + 3, over_after  # 3 s: the daemon's own look interval and start-up
        assert work.returncode == 128 + signal.SIGABRT
        assert f"ended by the daemon after incident {inc['id']}" in err.decode()
        (pid,) = inc["processes"]
        (record,) = [json.loads(p.read_text()) for p in (d.runtime_dir / "exits").glob(f"{pid}-*.json")]
        assert record["signal"] == signal.SIGABRT and record["ended_by"] == {"daemon": True, "incident": inc["id"]}
        assert d.metric("hangwatchd_jobs_aborted_total") == 1.0


def test_a_rank_that_ignores_sigabrt_is_killed_after_the_grace(tmp_path: Path) -> None:
    with Daemon(tmp_path, config={**FAST, "on_hang": "abort", "abort_grace": 1.0}) as d:  # root's config, no flag
        work = d.run([sys.executable, "-c", STUBBORN], "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
        try:
            assert work.stdout is not None and work.stdout.readline().strip() == b"stopped beating"
            assert work.wait(timeout=TIMEOUT + 60 + 5) == 128 + signal.SIGKILL
        finally:
            stop(work)
        (inc,) = d.store().list()
        (over,) = events(d, "abort_grace_over")
        (aborted,) = events(d, "job_aborted")
        assert over["pid"] == inc["processes"][0] and aborted["incident"] == inc["id"]


def test_report_leaves_the_hung_job_running(tmp_path: Path) -> None:
    with Daemon(tmp_path, config={**FAST, "abort_grace": 1.0}) as d:  # on_hang defaults to report
        work = d.run(workload_argv(beats=5), "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
        # The job's own choice wins over root's abort: this one asked for report.
        d2 = None
        try:
            (inc,) = wait_for(d.store().list, 30, "the incident")
            wait_for(lambda: events(d, "incident_stored"), 10, "the incident logged (acting follows it at once)")
            (pid,) = inc["processes"]
            time.sleep(1.5)  # past the abort grace: a SIGKILL would have come by now
            assert work.poll() is None and Path(f"/proc/{pid}").exists()
            assert events(d, "job_aborted") == [] and d.metric("hangwatchd_jobs_aborted_total") == 0.0
        finally:
            stop(work)
        d2 = Daemon(tmp_path / "abort-config", config={**FAST, "on_hang": "abort", "abort_grace": 1.0})
        try:
            mine = d2.run(workload_argv(beats=5), "--heartbeat-timeout", str(TIMEOUT), "--on-hang", "report", stdout=subprocess.PIPE)
            try:
                wait_for(lambda: events(d2, "incident_stored"), 30, "the incident")
                time.sleep(1.5)
                assert mine.poll() is None and events(d2, "job_aborted") == []
            finally:
                stop(mine)
        finally:
            d2.stop()


# A process of another user that registers itself by hand in a job of the same name, asking for abort.
OTHER_USER = """
import json, os, sys, time
pid = os.getpid()
start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
reg = {"pid": pid, "start_time": start, "job": "train", "on_hang": "abort", "stack_timeout": 3600,
       "registered_at": time.time(), "version": 1}
path = f"{sys.argv[1]}/registrations/{pid}-{start}.json"
with open(path + ".tmp", "w") as f:
    json.dump(reg, f)
os.rename(path + ".tmp", path)
print("registered", flush=True)
time.sleep(600)
"""


@needs_root
def test_abort_never_ends_another_users_process_in_a_job_of_the_same_name() -> None:
    base = Path(tempfile.mkdtemp(prefix="hw-act-"))
    os.chmod(base, 0o755)
    try:
        with Daemon(base, config=FAST) as d:
            os.chmod(d.runtime_dir, 0o755)
            other = subprocess.Popen(["/usr/bin/python3", "-c", OTHER_USER, str(d.runtime_dir)], user="nobody", group="nogroup",
                                     extra_groups=[], cwd="/", stdout=subprocess.PIPE)
            try:
                assert other.stdout is not None and other.stdout.readline().strip() == b"registered"
                wait_for(lambda: any(e.get("pid") == other.pid for e in events(d, "process_registered")) or
                         str(other.pid) in (d.runtime_dir / "status.json").read_text(), 10, "nobody's process watched")
                mine = d.run(workload_argv(beats=5), "--job", "train", "--heartbeat-timeout", str(TIMEOUT), "--on-hang", "abort",
                             stdout=subprocess.PIPE)
                try:
                    assert mine.wait(timeout=60) == 128 + signal.SIGABRT
                finally:
                    stop(mine)
                (aborted,) = events(d, "job_aborted")
                assert other.poll() is None and other.pid not in aborted["pids"] and len(aborted["pids"]) == 1
            finally:
                stop(other)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- across nodes: the capture request carries the action ----------------------

RANK = """
import sys, threading, time, hangwatchd
for _ in range(10):
    hangwatchd.beat(); time.sleep(0.05)
print("running", flush=True)
if sys.argv[1] == "stuck":
    threading.Event().wait()
while True:
    hangwatchd.beat(); time.sleep(0.1)
"""


@pytest.fixture
def s3() -> Iterator[S3Server]:
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


def test_abort_ends_the_jobs_ranks_on_every_node_after_each_nodes_capture(tmp_path: Path, s3: S3Server) -> None:
    cfg = {**FAST, "store_poll_interval": 0.5}
    with Daemon(tmp_path / "a", "--store", s3.url(), "--node-name", "node-a", env=s3.env, config=cfg) as a, \
         Daemon(tmp_path / "b", "--store", s3.url(), "--node-name", "node-b", env=s3.env, config=cfg) as b:
        r0 = a.run([sys.executable, "-c", RANK, "stuck"], "--job", "j", "--rank", "0", "--heartbeat-timeout", "2",
                   "--on-hang", "abort", stdout=subprocess.PIPE)
        r1 = b.run([sys.executable, "-c", RANK, "beating"], "--job", "j", "--rank", "1", "--heartbeat-timeout", "2",
                   "--on-hang", "abort", stdout=subprocess.PIPE)
        try:
            assert r0.wait(timeout=60) == 128 + signal.SIGABRT
            assert r1.wait(timeout=30) == 128 + signal.SIGABRT  # healthy-looking here, but its job hung
        finally:
            stop(r0, r1)
        (inc_b,) = b.store().list()
        assert inc_b["reason"] == "job-request"
        (ab,) = events(b, "job_aborted")
        assert ab["incident"] == inc_b["id"] and ab["timestamp"] >= events(b, "incident_stored")[0]["timestamp"]
