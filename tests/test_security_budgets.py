"""The trust boundary over time: budgets, dumps, the shared store and what is shown.

The daemon runs as root and the attacker as uid 65534 (nobody), with real files,
FIFOs, processes, a real S3 server and the real CLI. Each test is one finding of
issue 17 (the part about budgets, dumps, the store and the terminal): what a
user of the node would see, and, where the attack could delay others, that a
root workload's hang during it is still stored within its timeout + 10 s.
Tests that need root skip, saying so, as an ordinary user.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

from .conftest import FIXTURES
from .s3server import S3Server
from .test_security import (  # noqa: F401 - fixtures
    NOBODY,
    QUICK,
    SYSTEM_PYTHON,
    TIMEOUT,
    Attacker,
    RootHang,
    attacker,
    base,
    needs_root,
    nobody_can_read,
)

GiB = 1 << 30
SLACK = 10.0  # a root workload's hang is stored within its timeout + this, whatever the attack


def stored_within(victim: RootHang, slack: float = SLACK) -> dict[str, object]:
    """The root workload's incident, stored within its timeout + ``slack`` seconds of its last beat."""
    stopped = wait_for(lambda: victim.stopped, 60, "the root workload's last beat")[0]

    def mine() -> dict[str, object] | None:
        return next((i for i in victim.d.store().list() if i["job"] == victim.job and i["reason"] == "heartbeat"), None)

    inc = wait_for(mine, TIMEOUT + slack + 30, "the root workload's incident")
    took = time.monotonic() - stopped
    assert took <= TIMEOUT + slack, f"the root workload's hang took {took:.1f} s to be stored during the attack"
    print(f"root hang stored {took:.2f} s after its last beat (timeout {TIMEOUT:g} s)")
    return inc


class RootHangWith(RootHang):
    """A root workload that beats, then hangs, started with ``env`` added to its environment."""

    def __init__(self, d: ScratchDaemon, env: dict[str, str], job: str = "root-victim") -> None:
        self.d, self.job = d, job
        self.proc = d.run(workload_argv(beats=20, interval=0.05), "--heartbeat-timeout", str(TIMEOUT), "--job", job,
                          stdout=subprocess.PIPE, start_new_session=True, env=dict(os.environ, **env))
        self.stopped = []
        threading.Thread(target=self._read, daemon=True).start()


def events(d: ScratchDaemon, name: str) -> list[dict[str, object]]:
    return [e for e in d.logs() if e.get("event") == name]


# -- High 5: retention counts what it owns ------------------------------------

@needs_root
def test_a_sparse_60_gib_file_in_the_dump_dir_deletes_no_incident(base: Path, attacker: Attacker) -> None:
    config = dict(QUICK, max_state_bytes="1GiB")
    with ScratchDaemon(base / "d", config=config) as d:
        victim = RootHang(d)
        try:
            kept = stored_within(victim)
        finally:
            victim.stop()
        dump_dir = Path(d.info["dump_dir"])
        # Where users write is not where root keeps incidents.
        assert not dump_dir.resolve().is_relative_to(d.state_dir.resolve())
    # Planted while the daemon is down; retention runs first thing at the next start.
    attacker.run(f"""
import os
for where in ({str(dump_dir)!r}, {str(d.state_dir / 'dumps')!r}):
    try:
        with open(os.path.join(where, 'core_x.1.1.nvcudmp.part'), 'wb') as f:
            f.truncate(60 << 30)
    except OSError:
        pass
""")
    assert (dump_dir / "core_x.1.1.nvcudmp.part").stat().st_size == 60 * GiB
    with ScratchDaemon(base / "d", config=config) as d:
        checked = wait_for(lambda: events(d, "retention_checked"), 20, "retention to run")
        assert int(str(checked[0]["store_bytes"])) < 64 << 20  # its own incidents, not the planted file
        assert events(d, "retention_removed") == []
        assert [i["id"] for i in d.store().list()] == [kept["id"]]
        assert Path(str(kept["dir"])).is_dir()


# -- High 6: the GPU-dump gate reads native frames; one user's flood takes one worker ----

def capture_steps(inc: dict[str, object]) -> list[dict[str, object]]:
    data = json.loads((Path(str(inc["dir"])) / "incident.json").read_text())
    return [s for p in data["processes"] for s in p["steps"]]


@needs_root
def test_processes_named_like_hung_gpu_work_take_no_gpu_dump_and_delay_no_one(base: Path, attacker: Attacker) -> None:
    bait = base / "bait"
    bait.mkdir()
    os.chown(bait, NOBODY, NOBODY)
    config = {"rescan_interval": 1.0, "capture_timeout": 30.0, "flight_recorder_timeout": 4.0, "gpu_dump": "confirmed"}
    with ScratchDaemon(base / "d", config=config) as d:  # py-spy --native, as deployed: the gate sees native frames
        evil = []
        for i in range(8):
            env = {"PATH": "/usr/bin:/bin", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(bait / f"fr{i}_"),
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(bait / f"trace{i}_"), "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1",
                   "CUDA_COREDUMP_PIPE": str(bait / "corepipe.%p"), "CUDA_COREDUMP_FILE": str(bait / "core_%p.nvcudmp")}
            p = attacker.spawn([SYSTEM_PYTHON, str(Path(__file__).with_name("attacker.py")), "register", str(d.runtime_dir),
                                "--timeout", "1", "--bait", str(bait)],
                               user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env=env, stdout=subprocess.PIPE)
            assert p.stdout is not None and p.stdout.readline().startswith("registered")
            evil.append(p.pid)
        victim = RootHang(d)
        try:
            stored_within(victim)
            # The rest of the user's captures waited for its one slot; no worker of anyone else's was taken.
            over = wait_for(lambda: [e for e in events(d, "capture_over_budget") if e.get("uid") == NOBODY], 20,
                            "the attacker's captures held to its budget")
            assert "captures_per_uid = 1" in str(over[0]["error"])
            theirs = wait_for(lambda: [i for i in d.settled() if set(i["processes"]) & set(evil)], 30,
                              "an attacker's hang captured, its evidence all in")
            for inc in theirs:
                (dump,) = [s for s in capture_steps(inc) if s["step"] == "cuda_dump"]
                assert dump.get("skipped") and "not confirmed" in str(dump["error"]), dump
            assert all(Path(f"/proc/{pid}").exists() for pid in evil)  # no GPU dump was asked of any of them
            assert d.proc.poll() is None
        finally:
            victim.stop()
            attacker.stop()


# -- High 8: what is read from the shared store ---------------------------------

def s3_client(s3: S3Server) -> Any:
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=s3.endpoint, aws_access_key_id="testing",
                                          aws_secret_access_key="testing", region_name="us-east-1")


def test_store_keys_and_file_names_are_checked_before_they_touch_a_path() -> None:
    from hangwatchd.fleet import layout

    assert layout.check_relpath("1/proc.json") == ("1", "proc.json")
    assert layout.check_relpath(f"{layout.seg('node:a/b')}-1/pyspy.json")
    for bad in ("1//etc/cron.d/x", "/etc/passwd", "1/../../x", "1/./x", "", "1/" + "a" * 300, "/".join(["a"] * 9),
                "1/x\x1b[2J", "1/.hidden", "1/a b"):
        with pytest.raises(layout.BadKey):
            layout.check_relpath(bad)


def test_analyze_store_writes_nothing_outside_its_directory(s3: S3Server, base: Path) -> None:
    target = base / "outside" / "pwned"
    c = s3_client(s3)
    now = time.time()
    parts = "nodes/nodeA/incidents/inc1/"
    good = {"pid": 1, "node": "nodeA", "rank": 0, "job": "evil", "cmdline": ["x"]}
    # Under the very key the manifest names, so that a reader that followed it would write outside.
    for rel, body in ((f"1//{str(target).lstrip('/')}", b"as root, outside"), ("1/proc.json", json.dumps(good).encode()),
                      ("incident.json", json.dumps({"processes": [{"pid": 1, "dir": "1"}]}).encode())):
        c.put_object(Bucket=s3.bucket, Key=f"hw/{parts}{rel}", Body=body)
    evil = {"node": "nodeA", "incident": "inc1", "time": now, "ranks": [0], "parts": parts,
            "files": [{"path": f"1//{str(target).lstrip('/')}"}, {"path": "1/proc.json"}]}
    c.put_object(Bucket=s3.bucket, Key="hw/jobs/evil/job-1/nodeA/inc1.json", Body=json.dumps(evil).encode())
    # A second node's part names only good files: it is still read.
    c.put_object(Bucket=s3.bucket, Key="hw/nodes/nodeB/incidents/inc2/1/proc.json", Body=json.dumps({**good, "node": "nodeB"}).encode())
    c.put_object(Bucket=s3.bucket, Key="hw/nodes/nodeB/incidents/inc2/incident.json",
                 Body=json.dumps({"processes": [{"pid": 1, "dir": "1"}]}).encode())
    c.put_object(Bucket=s3.bucket, Key="hw/jobs/evil/job-1/nodeB/inc2.json", Body=json.dumps(
        {"node": "nodeB", "incident": "inc2", "time": now, "ranks": [1], "parts": "nodes/nodeB/incidents/inc2/",
         "files": [{"path": "1/proc.json"}]}).encode())
    res = subprocess.run([sys.executable, "-m", "hangwatchd", "analyze", "--store", s3.url(), "--job", "evil", "--json"],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, **s3.env))
    assert res.returncode == 0, res.stderr
    assert not target.exists() and not target.parent.exists()
    merged = json.loads(res.stdout)
    assert "nodeB" in json.dumps(merged) and "store_part_refused" in res.stderr


def test_every_body_read_from_the_store_is_capped(s3: S3Server, tmp_path: Path) -> None:
    import tracemalloc

    from hangwatchd.fleet import reader
    from hangwatchd.fleet.agent import MAX_REQUEST, Agent
    from hangwatchd.fleet.url import parse

    c = s3_client(s3)
    c.create_bucket(Bucket=s3.bucket) if s3.bucket not in [b["Name"] for b in c.list_buckets()["Buckets"]] else None
    big = b'{"job": "j", "job_incident": "job-1", "node": "n2", "time": 1, "detail": "' + b"x" * (48 << 20) + b'"}'
    c.put_object(Bucket=s3.bucket, Key="hw/requests/j/latest-u1000.json", Body=big)
    c.put_object(Bucket=s3.bucket, Key="hw/jobs/j/job-1/n2/i.json", Body=big)
    env = dict(os.environ)
    os.environ.update(s3.env)
    try:
        agent = Agent(s3.url(), "n1", tmp_path, 60.0, 300.0, 10)
        client = agent.client()  # made before counting: a client's own models are not what is measured
        client.list_objects_v2(Bucket=s3.bucket, Prefix="hw/none")
        tracemalloc.start()
        try:
            assert agent._get_latest("j", 1000, conditional=False) is None  # the poller's one read
            assert reader.job_incidents(parse(s3.url()), "j", client=client) == []
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert peak < 16 << 20, f"{peak >> 20} MB held to read two 48 MB bodies"
    assert MAX_REQUEST < 1 << 20


# -- Medium: a forged capture request in the store ----------------------------------

def post_request(c: Any, s3: S3Server, job: str, job_incident: str, uid: int, on_hang: str = "report") -> None:
    """A request as a node writes it for the job ``job`` of user ``uid`` (fleet/layout.py)."""
    body = json.dumps({"job": job, "job_incident": job_incident, "node": "forged", "time": time.time(),
                       "reason": "heartbeat", "detail": "forged", "uid": uid, "on_hang": on_hang}).encode()
    c.put_object(Bucket=s3.bucket, Key=f"hw/requests/{job}/latest-u{uid}.json", Body=body)


@needs_root
def test_a_forged_store_request_takes_no_gpu_dump_and_pauses_a_healthy_process_once(base: Path, s3: S3Server) -> None:
    config = {"gpu_dump": "always", "pyspy_native": False, "store_poll_interval": 0.3, "job_incident_window": 2.0,
              "flight_recorder_timeout": 2.0, "capture_timeout": 20.0}
    with ScratchDaemon(base / "d", "--store", s3.url(), "--node-name", "n1", env=s3.env, config=config) as d:
        work = d.run([sys.executable, "-m", "hangwatchd.testing", "gpu-workload", "--beats", "100000",
                      "--dump", str(FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz")],
                     "--heartbeat-timeout", "5", "--job", "victim", "--rank", "0", stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            c = s3_client(s3)
            wait_for(lambda: d.metric("hangwatchd_watched_processes") or [e for e in events(d, "process_registered")],
                     10, "the workload watched")
            time.sleep(1.0)  # a poll or two: the node watches the job and polls its request key
            post_request(c, s3, "victim", "job-forged-1", os.getuid())
            (inc,) = wait_for(lambda: [i for i in d.settled() if i["reason"] == "job-request"], 30, "the requested capture")
            (dump,) = [s for s in capture_steps(inc) if s["step"] == "cuda_dump"]
            assert dump.get("skipped") and "shared store" in str(dump["error"]), dump
            assert work.poll() is None  # no dump ended it
            time.sleep(2.5)  # past the job-incident window: a new request is a new hang to the store
            post_request(c, s3, "victim", "job-forged-2", os.getuid())
            ignored = wait_for(lambda: events(d, "job_capture_request_ignored"), 15, "the second request refused")
            assert ignored[0]["job_incident"] == "job-forged-2"
            assert len([i for i in d.store().list() if i["reason"] == "job-request"]) == 1
            assert work.poll() is None
        finally:
            stop(work, group=True)


# -- Medium: another user listening on the job's NCCL RAS port -----------------------

FAKE_RAS = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(8)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    f = c.makefile("rb")
    for line in f:
        line = line.strip()
        if line.startswith(b"CLIENT PROTOCOL"):
            c.sendall(b"SERVER PROTOCOL 2\\n")
        elif line.startswith(b"TIMEOUT") or line.startswith(b"SET FORMAT"):
            c.sendall(b"OK\\n")
        elif line.endswith(b"STATUS"):
            c.sendall(sys.argv[2].encode())
            break
    f.close()
    c.close()
"""


@needs_root
def test_another_users_listener_on_the_jobs_ras_port_is_not_believed(base: Path, attacker: Attacker) -> None:
    from .s3server import free_port

    port = free_port()
    forged = "Job summary\\n===========\\n  Rank 7 (pid 4242 on node 10.9.9.9) is DEAD \\x1b[2J\\n"
    listener = attacker.spawn([SYSTEM_PYTHON, "-c", FAKE_RAS, str(port), forged], user=NOBODY, group=NOBODY,
                              extra_groups=[], cwd="/", stdout=subprocess.PIPE)
    assert listener.stdout is not None and listener.stdout.readline().startswith("listening")
    config = dict(QUICK, capture_steps=["proc", "pyspy", "nccl_ras"])
    with ScratchDaemon(base / "d", config=config) as d:
        victim = RootHangWith(d, {"NCCL_RAS_ADDR": f"127.0.0.1:{port}"})  # hangwatchd run keeps the address given
        try:
            first = stored_within(victim)
            inc = wait_for(lambda: next((i for i in d.settled() if i["id"] == first["id"]), None), 30, "its evidence all in")
        finally:
            victim.stop()
        pdir = next(p for p in Path(str(inc["dir"])).iterdir() if p.is_dir())
        assert not (pdir / "nccl-ras.txt").exists()
        (ras,) = [s for s in capture_steps(inc) if s["step"] == "nccl_ras"]
        assert not ras["ok"] and f"runs as uid {NOBODY}, not the job's uid 0" in str(ras["error"]), ras
        assert "10.9.9.9" not in (Path(str(inc["dir"])) / "incident.json").read_text()


# -- Medium: junk in the dump dir ------------------------------------------------------

def dump_file(pid: int, tag: int) -> str:
    return f"core_{socket.gethostname()}.{pid}.{1700000000 + tag}.nvcudmp"


def counted(d: ScratchDaemon, *reasons: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in d.scrape().splitlines()
               if line.startswith("hangwatchd_registration_errors_total{") and any(f'reason="{r}"' in line for r in reasons))


@needs_root
def test_300_junk_dumps_make_no_incidents_and_no_new_metric_series(base: Path, attacker: Attacker) -> None:
    with ScratchDaemon(base / "d", config=QUICK) as d:
        dumps = Path(d.info["dump_dir"])
        gone = 2**22 - 7  # a pid that names no process: a claim of the writer's own
        # A driver log naming an exception type of its own making: filed, counted as OTHER.
        attacker.run(f"""
import os
tmp = os.path.join({str(dumps)!r}, '.log')
open(tmp, 'w').write('[00:00:00.000000] coredump: Detected an exception of type CUDBG_EXCEPTION_FAKE4242 on device 0\\n')
os.rename(tmp, os.path.join({str(dumps)!r}, 'nodump_{socket.gethostname()}.{gone}.1.driver-log'))
""")
        wait_for(lambda: [i for i in d.store().list() if i["reason"] == "gpu-exception"], 20, "the planted report filed")
        assert d.metric("hangwatchd_gpu_exceptions_total", type="OTHER") == 1.0
        assert "FAKE4242" not in "".join(ln for ln in d.scrape().splitlines() if ln.startswith("hangwatchd_gpu_exceptions_total"))
        victim = RootHang(d)
        start = time.monotonic()
        try:
            attacker.run(f"""
import os
for i in range(300):
    tmp = os.path.join({str(dumps)!r}, '.junk%d' % i)
    open(tmp, 'wb').write(os.urandom(4096))
    os.rename(tmp, os.path.join({str(dumps)!r}, 'core_{socket.gethostname()}.{gone}.%d.nvcudmp' % (1700000000 + i)))
""")
            stored_within(victim)
            wait_for(lambda: counted(d, "dump_not_coredump", "dump_budget") == 300, 60, "every junk dump refused")
        finally:
            victim.stop()
        assert len([i for i in d.store().list() if i["reason"] == "gpu-exception"]) == 1
        assert not d.metric("hangwatchd_gpu_exceptions_total", type="UNREADABLE")  # none counted (the series may be there at 0)
        logged = [e for e in d.logs() if e.get("event") == "dump_refused"]
        minutes = (time.monotonic() - start) / 60
        assert len(logged) <= 60 + 60 * minutes + 6, len(logged)  # the user's log lines per minute, then counted only
        assert d.proc.poll() is None


@needs_root
def test_a_huge_junk_dump_with_a_coredump_header_is_compressed_within_its_limits(base: Path, attacker: Attacker) -> None:
    import lzma

    head = lzma.decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes())[:64]
    config = dict(QUICK, symbolize_cpu_seconds=1.0, symbolize_timeout=5.0)
    with ScratchDaemon(base / "d", config=config) as d:
        dumps = Path(d.info["dump_dir"])
        victim = RootHang(d)
        try:
            start = time.monotonic()
            attacker.run(f"""
import os
tmp = os.path.join({str(dumps)!r}, '.big')
with open(tmp, 'wb') as f:
    f.write({head!r})
    f.truncate(40 << 30)
os.rename(tmp, os.path.join({str(dumps)!r}, {dump_file(2**22 - 9, 1)!r}))
""")
            (inc,) = wait_for(lambda: [i for i in d.store().list() if i["reason"] == "gpu-exception"], 60, "the junk filed")
            took = time.monotonic() - start
            stored_within(victim)
        finally:
            victim.stop()
        (step,) = capture_steps(inc)
        assert "could not keep the dump" in str(step["error"]) and "limit" in str(step["error"]), step
        assert took < 5.0 + 15.0, f"{took:.1f} s to give up on a 40 GiB junk dump"
        assert not list(Path(str(inc["dir"])).rglob("coredump.nvcudmp.zst"))


# -- Medium: what a terminal is shown ---------------------------------------------------

HOSTILE = "evil\x1b]0;owned\x07\x1b[2J\r\u202eNOTICE\x9b31m"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hangwatchd", *args], capture_output=True, text=True, timeout=60)


def shown_escaped(out: str, whole: bool = True) -> None:
    assert not any(c in out for c in "\x1b\x07\r\u202e\x9b"), repr(out[:400])
    shown = "evil\\x1b]0;owned\\x07\\x1b[2J\\x0d\\u202eNOTICE\\x9b31m"
    assert (shown if whole else shown[:20]) in out, out[:2000]


@needs_root
def test_a_users_control_characters_reach_no_terminal(base: Path, attacker: Attacker) -> None:
    bait = base / "bait"
    bait.mkdir()
    os.chown(bait, NOBODY, NOBODY)
    with ScratchDaemon(base / "d", config=QUICK) as d:
        p = attacker.spawn([SYSTEM_PYTHON, str(Path(__file__).with_name("attacker.py")), "register", str(d.runtime_dir),
                            "--timeout", "1", "--bait", str(bait), "--job", HOSTILE],
                           user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE)
        assert p.stdout is not None and p.stdout.readline().startswith("registered")
        # status.json is written off the loop, at most once a second: wait until the process shows.
        status = wait_for(lambda: r if (r := cli("status", "--runtime-dir", str(d.runtime_dir))).returncode == 0
                          and str(p.pid) in r.stdout else None, 10, "the attacker's process in hangwatchd status")
        shown_escaped(status.stdout, whole=False)  # the table cuts a job name at 32 characters
        (inc,) = wait_for(lambda: [i for i in d.store().list() if p.pid in i["processes"]], 30, "the attacker's hang stored")
        listed = cli("incidents", "--state-dir", str(d.state_dir))
        assert listed.returncode == 0, listed.stderr
        assert "\x1b" not in listed.stdout and "\\x1b" in listed.stdout
        shown = cli("show", str(inc["id"]), "--state-dir", str(d.state_dir))
        assert shown.returncode == 0, shown.stderr
        shown_escaped(shown.stdout)
        # --json keeps the text whole, JSON-escaped; the page escapes for HTML.
        as_json = cli("show", str(inc["id"]), "--state-dir", str(d.state_dir), "--json")
        assert json.loads(as_json.stdout)["job"] == HOSTILE


def test_every_text_renderer_escapes_what_others_wrote() -> None:
    from hangwatchd.report import incident, tables
    from hangwatchd.report.terminal import escape

    assert escape("plain text, ünïcode ✓") == "plain text, ünïcode ✓"
    assert escape("a\nb\tc\x00") == "a\\x0ab\\x09c\\x00"
    assert escape(escape(HOSTILE)) == escape(HOSTILE)
    analysis = {"summary": f"Rank 1 {HOSTILE} is dead", "culprits": [
        {"pid": 1, "rank": 1, "node": HOSTILE, "reason": HOSTILE, "location": HOSTILE}],
        "ranks": [{"rank": 1, "pid": 1, "node": HOSTILE, "verdict": "dead", "detail": HOSTILE}],
        "rests_on": [HOSTILE], "unreadable": [HOSTILE]}
    data = {"id": "x", "time": 0, "host": HOSTILE, "reason": "heartbeat", "detail": HOSTILE, "job": HOSTILE,
            "notify_status": HOSTILE, "analysis": analysis,
            "processes": [{"pid": 1, "cmdline": [HOSTILE], "steps": [{"step": "nccl_ras", "ok": False, "seconds": 0.1,
                                                                       "error": HOSTILE}],
                           "stacks": [{"thread_name": HOSTILE, "frames": [{"name": HOSTILE, "filename": "x.py", "line": 1}]}]}]}
    for out in (incident.render_text(data), incident.render_analysis(analysis),
                tables.status({"daemon": {"version": HOSTILE}, "processes": [
                    {"pid": 1, "job": HOSTILE, "state": "healthy", "timeout": 1.0, "cmdline": [HOSTILE]}]}),
                tables.incidents([{"id": "x", "complete": True, "time": 0, "reason": HOSTILE, "job": HOSTILE,
                                   "processes": [1], "summary": HOSTILE}]),
                tables.job_incidents([{"job_incident": HOSTILE, "time": 0, "job": HOSTILE, "nodes": [HOSTILE],
                                       "ranks": [1], "reason": HOSTILE}])):
        assert not any(c in out for c in "\x1b\x07\r\u202e\x9b"), repr(out[:300])
        assert "\\x1b" in out


def test_symbol_names_from_a_dump_reach_no_terminal_raw(tmp_path: Path) -> None:
    import lzma

    from hangwatchd.cudacore.symbolize import Symbolized, symbolize
    from hangwatchd.report import gpu

    raw = tmp_path / "d.nvcudmp"
    raw.write_bytes(lzma.decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes()))
    data = symbolize(raw, nvdisasm=None).to_dict()
    real = data["kernels"][0]["name"]  # type: ignore[index]  # to_dict is JSON: a list of dicts here
    text = json.dumps(data).replace(json.dumps(real)[1:-1], json.dumps(HOSTILE)[1:-1])
    out = gpu.render(Symbolized.from_dict(json.loads(text)))
    assert not any(c in out for c in "\x1b\x07\r\u202e\x9b") and "evil\\x1b]0;owned" in out


# -- Medium: a flood of registration files, and the log ------------------------------

@needs_root
def test_a_flood_of_bad_registration_files_is_counted_not_logged_line_by_line(base: Path, attacker: Attacker) -> None:
    n = 3000
    with ScratchDaemon(base / "d", config=QUICK) as d:
        victim = RootHang(d)
        start = time.monotonic()
        try:
            attacker.run(f"""
import os
regs = {str(d.runtime_dir / 'registrations')!r}
for i in range({n}):
    tmp = os.path.join(regs, '.f%d' % i)
    open(tmp, 'w').write('{{"version": 1, "pid": ')
    os.rename(tmp, os.path.join(regs, '%d-1.json' % (100000 + i)))
""")
            stored_within(victim)

            def refused() -> float:
                return sum(float(ln.rsplit(" ", 1)[1]) for ln in d.scrape().splitlines()
                           if ln.startswith("hangwatchd_registration_errors_total{"))
            wait_for(lambda: refused() >= n, 60, "every bad file counted")
        finally:
            victim.stop()
        logged = [e for e in d.logs() if e.get("event") == "registration_refused"]
        minutes = (time.monotonic() - start) / 60
        assert len(logged) <= 60 + 60 * minutes + 5, f"{len(logged)} log lines for one user's {n} bad files"
        assert d.log.stat().st_size < 1 << 20
        assert d.proc.poll() is None


# -- Medium: the symbolising child is not root ------------------------------------------

@pytest.fixture(scope="module")
def forkserver() -> Iterator[None]:
    """The sandbox's warm fork server, started before any test's own processes are counted."""
    from hangwatchd.cudacore import sandbox

    sandbox.start()
    try:
        yield
    finally:
        sandbox.stop()


def _ids(pid: int) -> tuple[list[str], list[str], str]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    field = {ln.split(":")[0]: ln.split(":", 1)[1].split() for ln in status}
    return field["Uid"], field["Gid"], " ".join(field["Groups"])


@needs_root
@pytest.mark.parametrize("owner", [0, 12345], ids=["root-owned", "a-users"])
def test_the_symbolising_child_runs_as_the_dumps_owner_or_nobody(owner: int, base: Path, forkserver: None) -> None:
    import lzma

    from hangwatchd.cudacore import sandbox
    from hangwatchd.cudacore.sandbox import Limits

    dump = base / "d.nvcudmp"
    dump.write_bytes(lzma.decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes()))
    os.chown(dump, owner, owner)
    os.chmod(dump, 0o600)  # only its owner (and root) may read it: the child opened it before the drop
    assert sandbox.symbolize(dump, Limits(cpu_seconds=30, memory_mb=2048, wall_seconds=30)).kernels
    where = base / "w"
    where.mkdir()
    os.chmod(where, 0o1777)
    pidfile = where / "pid"
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(_stopped(sandbox, dump, pidfile)))
    t.start()
    try:
        pid = int(wait_for(lambda: pidfile.read_text() if pidfile.exists() else None, 10, "the child's helper"))
        uids, gids, groups = _ids(pid)
        want = str(owner or NOBODY)
        assert uids == [want] * 4 and groups == "", (uids, groups)
        assert gids[0] != "0"
    finally:
        t.join()


def _stopped(sandbox: Any, dump: Path, pidfile: Path) -> object:
    try:
        return sandbox.symbolize(dump, sandbox.Limits(30, 1024, 5), _hook=f"sleep:{pidfile}")
    except Exception as exc:  # noqa: BLE001 - stopped at its wall deadline, as meant
        return exc


# -- the budgets themselves (any user) ---------------------------------------------------

def test_budgets_bound_each_user_apart_and_never_root() -> None:
    from hangwatchd.host.user_limits import Budgets

    b = Budgets(captures_in_flight=1, capture_seconds_per_hour=60.0, per_minute={"dump": 6, "incident": 6, "log": 60})
    assert b.start_capture(1000, 0.0) is None
    assert "captures_per_uid = 1" in (b.start_capture(1000, 0.0) or "")
    assert b.start_capture(1001, 0.0) is None  # another user's capture does not wait for the first's
    assert all(b.start_capture(0, 0.0) is None for _ in range(50))  # root: never limited
    b.end_capture(1000, 90.0, 90.0)  # a capture that took 90 s of a 60 s hour
    assert "capture_seconds_per_uid" in (b.start_capture(1000, 90.0) or "")
    assert b.start_capture(1000, 90.0 + 3600.0) is None  # an hour later it has its time again
    took = sum(b.allow("dump", 1000, 100.0 + i * 0.1) for i in range(600))  # a minute of asking
    assert 6 <= took <= 6 + 6 + 1
    assert sum(b.allow("log", 1002, 100.0) for _ in range(1000)) == 60
    assert all(b.allow("dump", 0, 100.0) for _ in range(1000))


def test_the_spool_keeps_a_bounded_share_for_each_user(tmp_path: Path) -> None:
    from hangwatchd.incidents.spool import Spool

    spool = Spool(tmp_path / "spool", per_uid_max=1 << 20)

    def keep(uid: int) -> Path | None:
        draft = spool.begin("gpu-exception", None, [])
        (draft.path / "driver.log").write_bytes(os.urandom(300 << 10))
        return spool.keep(draft, {"id": draft.id}, "s", [uid])

    kept = [keep(NOBODY) for _ in range(8)]
    assert sum(k is not None for k in kept) == 3  # 3 x 300 KiB fit in 1 MiB, the 4th does not
    assert all(keep(1000) is not None for _ in range(3))  # another user's share is untouched
    assert all(keep(0) is not None for _ in range(6))  # root's reports are never dropped
    assert spool.bytes_of(NOBODY) <= 1 << 20
    assert len(spool.pending()) == 3 + 3 + 6
    assert not list((tmp_path / "spool").glob(".partial-*"))  # a dropped draft leaves nothing behind
