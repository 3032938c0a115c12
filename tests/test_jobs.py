"""Jobs as the unit: every rank below a launcher is watched, and a rank that is gone is named.

Through the real daemon, with real launchers and ranks (child processes that
beat, wait and exit, or are SIGKILLed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

from .conftest import hangwatchd

FAST = {"gpu_dump": "never", "pyspy_native": False, "startup_grace": 2.0}

# A launcher like torchrun, in small: starts WORLD ranks with RANK, LOCAL_RANK and
# WORLD_SIZE set, waits for them. It never beats.
LAUNCHER = """
import os, subprocess, sys
rank_code = sys.argv[1]
procs = [subprocess.Popen([sys.executable, "-c", rank_code],
                          env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"))
         for r in range(2)]
sys.exit(max(p.wait() for p in procs))
"""
# Rank 0 beats 60 times, then waits forever; rank 1 beats on.
RANK = """
import os, threading, time, hangwatchd
n = 60 if os.environ["RANK"] == "0" else 10**9
for _ in range(n):
    hangwatchd.beat()
    time.sleep(0.05)
print("rank", os.environ["RANK"], "stopped beating", flush=True)
threading.Event().wait()
"""


def status(d: ScratchDaemon) -> list[dict[str, Any]]:
    res = hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["processes"]



def analysis(inc: dict[str, Any]) -> dict[str, Any]:
    return json.loads((Path(inc["dir"]) / "incident.json").read_text())["analysis"]


def test_every_rank_below_a_launcher_is_watched_and_the_hung_one_is_captured_with_its_mate(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config=FAST) as d:
        run = d.run([sys.executable, "-c", LAUNCHER, RANK], "--job", "J", "--heartbeat-timeout", "2",
                    start_new_session=True)
        try:
            procs = wait_for(lambda: (lambda p: p if {x["rank"] for x in p if x["role"] == "workload"} == {0, 1} else None)(status(d)),
                             20, "both ranks registered")
            ranks = {p["rank"]: p for p in procs if p["role"] == "workload"}
            assert all(p["job"] == "J" and p["world_size"] == 2 and p["source"] == "rank" for p in ranks.values())
            assert all(p["timeout"] == 2.0 for p in ranks.values())  # the launcher's --heartbeat-timeout
            (launcher,) = [p for p in procs if p["role"] == "launcher"]
            assert launcher["pid"] not in {p["pid"] for p in ranks.values()}
            assert all(p["launcher"] == launcher["pid"] for p in ranks.values())
            assert ranks[0]["pid"] != ranks[1]["pid"]
            wait_for(lambda: all(p["beats"] > 0 for p in status(d) if p["role"] == "workload"), 10, "both ranks beating")
            # Their beats land in their own segments, never in the launcher's.
            assert [p["beats"] for p in status(d) if p["role"] == "launcher"] == [0]
            table = hangwatchd("status", "--runtime-dir", str(d.runtime_dir)).stdout.splitlines()
            rows = {ln.split()[0]: ln.split() for ln in table if ln.split() and ln.split()[0].isdigit()}
            assert rows[str(launcher["pid"])][1:3] == ["J", "launcher"]
            assert [rows[str(ranks[r]["pid"])][1:3] for r in (0, 1)] == [["J", "0"], ["J", "1"]]

            (inc,) = wait_for(d.settled, 30, "the incident", every=0.2)
            assert inc["reason"] == "heartbeat" and inc["job"] == "J"
            assert inc["processes"][0] == ranks[0]["pid"]  # the hung rank first
            assert set(inc["processes"]) == {ranks[0]["pid"], ranks[1]["pid"]}  # its mate too, not the launcher
            proc0 = json.loads((Path(inc["dir"]) / str(ranks[0]["pid"]) / "proc.json").read_text())
            assert (proc0["rank"], proc0["world_size"], proc0["job"]) == (0, 2, "J")

            d.looked(6, after=time.time() + 3)  # looked at past the startup grace: the launcher, which never beats, is not hung
            assert len(d.store().list()) == 1
            after = {p["pid"]: p for p in status(d)}
            assert after[launcher["pid"]]["state"] == "healthy"
            assert after[ranks[1]["pid"]]["state"] in ("captured", "healthy")
        finally:
            stop(run, sig=signal.SIGKILL, group=True)


def _job_rank(d: ScratchDaemon, rank: int, argv: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    return d.run(argv, "--job", "J", "--heartbeat-timeout", "2", env=env, start_new_session=True, stdout=subprocess.PIPE)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_rank_that_left_is_the_first_culprit_and_leads_the_summary(tmp_path: Path, how: str) -> None:
    with ScratchDaemon(tmp_path, config=FAST) as d:
        r0 = _job_rank(d, 0, workload_argv(beats=100, interval=0.05))
        r1 = _job_rank(d, 1, workload_argv(beats=30 if how == "exit" else 10**9, interval=0.05, then="exit"))
        try:
            procs = wait_for(lambda: (lambda p: p if {x["rank"] for x in p} == {0, 1} else None)(status(d)), 20, "both ranks")
            pid = {p["rank"]: p["pid"] for p in procs}
            if how == "sigkill":
                time.sleep(1.0)
                os.kill(pid[1], signal.SIGKILL)  # from outside, as the OOM killer would
            assert r1.wait(20) == (0 if how == "exit" else 128 + 9)
            left = time.time()
            assert r0.stdout is not None and r0.stdout.readline().strip() == b"stopped beating"
            stopped = time.time()

            (inc,) = wait_for(d.settled, 30, "the incident", every=0.2)
            assert inc["processes"] == [pid[0]]
            exit_json = json.loads((Path(inc["dir"]) / str(pid[1]) / "exit.json").read_text())
            assert (exit_json["rank"], exit_json["pid"], exit_json["job"], exit_json["world_size"]) == (1, pid[1], "J", 2)
            # Its last beat as its parent read it after the exit: just before its end (the interpreter's
            # exit and the parent's wake-up take their time on a loaded machine).
            assert exit_json["beats"] >= 10 and 0 <= exit_json["time"] - exit_json["last_beat_time"] < 3.0
            if how == "exit":
                assert (exit_json["status"], exit_json["signal"]) == (0, None)
                how_text = "exited with status 0"
            else:
                assert (exit_json["status"], exit_json["signal"], exit_json["signal_name"]) == (None, 9, "SIGKILL")
                how_text = "was killed by signal 9 (SIGKILL)"
            assert abs(exit_json["time"] - left) < 2.0

            a = analysis(inc)
            assert a["culprits"][0]["rank"] == 1 and a["culprits"][0]["pid"] == pid[1]
            assert how_text in a["culprits"][0]["reason"]
            clock = time.strftime("%H:%M:%S", time.localtime(exit_json["time"]))
            m = re.match(rf"Rank 1 {re.escape(how_text)} at {clock}\b.*?, ([0-9.]+) s before rank 0 stopped", a["summary"])
            assert m, a["summary"]
            assert abs(float(m.group(1)) - (stopped - left)) < 2.0
            assert {v["rank"]: v["verdict"] for v in a["ranks"]}[1] == "exited"

            shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir))
            assert shown.stdout.startswith(f"Rank 1 {how_text}"), shown.stdout[:500]
            again = hangwatchd("analyze", inc["dir"], "--json")
            assert json.loads(again.stdout)["summary"] == a["summary"]
        finally:
            for p in (r0, r1):
                stop(p, sig=signal.SIGKILL, group=True)


def test_a_workload_that_never_beats_is_not_hung_after_the_startup_grace(tmp_path: Path) -> None:
    code = "import time\ntime.sleep(60)\n"
    with ScratchDaemon(tmp_path, config={**FAST, "stack_interval": 0.5, "stack_window": 2.0}) as d:
        quiet = d.run([sys.executable, "-c", code], "--job", "server", start_new_session=True)
        declared = d.run([sys.executable, "-c", code], "--job", "batch", "--heartbeat-timeout", "1", start_new_session=True)
        try:
            wait_for(lambda: len(status(d)) == 2, 20, "both registered")
            # A declared timeout is a promise to beat: that one is hung after the grace.
            (inc,) = wait_for(d.settled, 20, "the declared one's incident", every=0.2)
            meta = json.loads((Path(inc["dir"]) / "incident.json").read_text())
            assert inc["job"] == "batch" and "no first beat" in meta["detail"]
            d.looked(4, after=time.time() + 2)  # the server looked at again: watched by its stack, never hung for a beat
            assert [i["job"] for i in d.store().list()] == ["batch"]
            (p,) = [p for p in status(d) if p["job"] == "server"]
            assert p["state"] == "healthy" and p["beats"] == 0
            warned = [e for e in d.logs() if e.get("event") == "never_beat"]
            assert len(warned) == 1 and warned[0]["watched_by"] == "stack"
            # Watched by its stack from then on: sampled, found frozen but idle (a sleep), let be.
            wait_for(lambda: [e for e in d.logs() if e.get("pid") == p["pid"]
                              and e.get("event") in ("stack_sample_failed", "stack_frozen_idle")], 20, "its stack sampled")
            assert [i["job"] for i in d.store().list()] == ["batch"]
        finally:
            stop(quiet, sig=signal.SIGKILL, group=True)
            stop(declared, sig=signal.SIGKILL, group=True)


def test_analyze_a_hand_made_directory_with_an_exited_rank_and_one_missing(tmp_path: Path) -> None:
    inc = tmp_path / "by-hand"
    (inc / "4100").mkdir(parents=True)
    (inc / "4100" / "proc.json").write_text(json.dumps({"pid": 4100, "rank": 0, "world_size": 3, "job": "J"}))
    (inc / "4101").mkdir()
    t = 1764500000.0
    (inc / "4101" / "exit.json").write_text(json.dumps({"pid": 4101, "rank": 1, "world_size": 3, "signal": 9,
                                                          "signal_name": "SIGKILL", "time": t}))
    res = hangwatchd("analyze", str(inc), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    clock = time.strftime("%H:%M:%S", time.localtime(t))
    assert out["summary"].startswith(f"Rank 1 was killed by signal 9 (SIGKILL) at {clock}")
    assert "Rank 2 of world size 3 is not on this node" in out["summary"]
    assert out["culprits"][0]["rank"] == 1
    verdicts = {v["rank"]: v["verdict"] for v in out["ranks"]}
    assert verdicts == {0: "unknown", 1: "exited", 2: "not-here"}


def test_a_launcher_known_by_name_is_never_hung_for_its_own_beats(tmp_path: Path) -> None:
    # torchrun whose ranks take longer than the startup grace to beat (loading a model):
    # the launcher's --heartbeat-timeout is for its ranks, not for itself.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    torchrun = bindir / "torchrun"
    torchrun.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    torchrun.chmod(0o755)
    with ScratchDaemon(tmp_path / "d", config=FAST) as d:
        run = d.run([str(torchrun), "--nproc-per-node", "2", "train.py"], "--job", "J", "--heartbeat-timeout", "1",
                    start_new_session=True)
        try:
            (p,) = wait_for(lambda: status(d), 20, "the launcher registered")
            assert p["role"] == "launcher"
            d.looked(4, after=time.time() + 4)  # looked at past twice the startup grace, four times its timeout
            assert d.store().list() == []
            assert status(d)[0]["state"] == "healthy"
        finally:
            stop(run, sig=signal.SIGKILL, group=True)


def test_an_exit_record_is_believed_only_as_a_small_regular_file_of_its_process(tmp_path: Path) -> None:
    from hangwatchd.model import ProcessId
    from hangwatchd.workload import exits

    (tmp_path / "exits").mkdir()
    me = ProcessId(4242, 777)
    exits.write(tmp_path, me, -9, 1000.5)
    rec = exits.read(tmp_path, me, os.getuid())
    assert rec == exits.ExitRecord(None, 9, 1000.5, None, None) and rec.describe() == "was killed by signal 9 (SIGKILL)"
    path = tmp_path / "exits" / exits.file_name(me)
    other = ProcessId(4242, 778)  # the same pid, another process: its record says otherwise
    os.rename(path, tmp_path / "exits" / exits.file_name(other))
    assert exits.read(tmp_path, other, os.getuid()) is None
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"pid": 4242, "start_time": 777, "status": 3, "time": 1.0}))
    path.symlink_to(secret)
    assert exits.read(tmp_path, me, os.getuid()) is None  # never through a link
    path.unlink()
    path.write_text(json.dumps({"pid": 4242, "start_time": 777, "status": 3, "pad": "x" * 5000}))
    assert exits.read(tmp_path, me, os.getuid()) is None  # too big
    path.write_text(json.dumps({"pid": 4242, "start_time": 777, "status": "0; rm -rf", "signal": 10**6, "time": -5}))
    assert exits.read(tmp_path, me, os.getuid()) == exits.ExitRecord(None, None, None)  # nonsense fields dropped
    path.unlink()
    path.mkdir()
    assert exits.read(tmp_path, me, os.getuid()) is None
    path.rmdir()
    fifo = path
    os.mkfifo(fifo)
    start = time.monotonic()
    assert exits.read(tmp_path, me, os.getuid()) is None and time.monotonic() - start < 1  # never blocks
    fifo.unlink()
    exits.write(tmp_path, me, 0, 1.0)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)  # another user's file cannot speak for this process
        assert exits.read(tmp_path, me, os.getuid() or 1000) is None


def test_a_rank_that_exits_between_the_declaration_and_its_capture_is_said_to_have_exited(tmp_path: Path) -> None:
    """The loop had not yet heard that rank 1 left when rank 0 was declared hung (a loaded node), so
    rank 1 is one of the capture's targets: found gone, it is written as an exited rank with its
    launcher's record, and the verdict leads with it, not with "nothing was captured"."""
    from hangwatchd.analyze.verdict import analyze
    from hangwatchd.capture import ProcStep
    from hangwatchd.daemon.make_incident import make_incident
    from hangwatchd.host import procfs
    from hangwatchd.host.deadline import Deadline
    from hangwatchd.incidents.store import Store
    from hangwatchd.model import Registration, Suspicion
    from hangwatchd.workload import exits

    (tmp_path / "run" / "exits").mkdir(parents=True)
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    left = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ranks = [wait_for(lambda: procfs.identify(waiting.pid), 5, "rank 0"), wait_for(lambda: procfs.identify(left.pid), 5, "rank 1")]
        left.communicate(timeout=10)  # rank 1 leaves (its data ran out) once both are known
        assert left.returncode == 0
        exits.write(tmp_path / "run", ranks[1], 0, time.time())  # what hangwatchd run, its parent, leaves
        regs = [Registration(process=p, uid=os.getuid(), job="train", rank=r, world_size=2, cmdline=("python",))
                for r, p in enumerate(ranks)]
        store = Store(tmp_path / "state")
        store.open()
        make_incident(store, [(ProcStep(), 5.0)], regs, Suspicion("heartbeat", "no beat for 3 s", time.time() - 3),
                      Deadline.after(30.0), runtime_dir=tmp_path / "run")
        (inc,) = store.list()
        record = json.loads((Path(inc["dir"]) / str(left.pid) / "exit.json").read_text())
        assert (record["rank"], record["status"], record["time_source"]) == (1, 0, "hangwatchd run (the parent)")
        assert analyze(Path(inc["dir"])).summary.startswith("Rank 1 exited with status 0")
    finally:
        stop(waiting, sig=signal.SIGKILL)


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                            lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                            max_leaves=20)
_exit_like = st.fixed_dictionaries({}, optional={k: _json_values for k in (
    "pid", "start_time", "rank", "world_size", "status", "signal", "signal_name", "time", "beats",
    "last_beat_time", "last_stack", "job_hung")})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=_exit_like | _json_values,
       proc=st.fixed_dictionaries({"pid": st.just(7)}, optional={"rank": st.none() | st.integers(-3, 9),
                                                                  "world_size": st.none() | st.integers(-3, 10**9)}))
def test_any_exit_json_gives_a_verdict_never_an_error(tmp_path: Path, record: Any, proc: Any) -> None:
    from hangwatchd.analyze.verdict import analyze
    from hangwatchd.model import ProcessId
    from hangwatchd.workload import exits

    inc = tmp_path / "inc"
    shutil.rmtree(inc, ignore_errors=True)
    (inc / "7").mkdir(parents=True)
    (inc / "7" / "proc.json").write_text(json.dumps(proc))
    (inc / "8").mkdir()
    (inc / "8" / "exit.json").write_text(json.dumps(record))
    out = analyze(inc)
    assert isinstance(out.summary, str) and out.summary
    (tmp_path / "exits").mkdir(exist_ok=True)
    (tmp_path / "exits" / exits.file_name(ProcessId(8, 1))).write_text(json.dumps(record))
    rec = exits.read(tmp_path, ProcessId(8, 1), os.getuid())
    assert rec is None or isinstance(rec.describe(), str)


def test_a_rank_that_ran_out_of_data_below_a_launcher_leads_the_verdict(tmp_path: Path) -> None:
    # torchrun waits for the others when a rank exits 0: the survivor hangs in its next collective.
    uneven = RANK.replace('n = 60 if os.environ["RANK"] == "0" else 10**9', 'n = 60 if os.environ["RANK"] == "0" else 20') \
                 .replace("threading.Event().wait()", "threading.Event().wait() if os.environ['RANK'] == '0' else None")
    with ScratchDaemon(tmp_path, config=FAST) as d:
        run = d.run([sys.executable, "-c", LAUNCHER, uneven], "--job", "J", "--heartbeat-timeout", "2", start_new_session=True)
        try:
            procs = wait_for(lambda: (lambda p: p if {x["rank"] for x in p if x["role"] == "workload"} == {0, 1} else None)(status(d)),
                             20, "both ranks registered")
            pid = {p["rank"]: p["pid"] for p in procs if p["role"] == "workload"}
            (inc,) = wait_for(d.settled, 30, "the incident", every=0.2)
            assert inc["processes"] == [pid[0]]
            exit_json = json.loads((Path(inc["dir"]) / str(pid[1]) / "exit.json").read_text())
            assert (exit_json["rank"], exit_json["status"], exit_json["signal"]) == (1, None, None)  # not its parent: no status
            assert exit_json["beats"] == 20
            a = analysis(inc)
            assert a["culprits"][0]["rank"] == 1
            assert re.match(r"Rank 1 exited at \d\d:\d\d:\d\d\b.*?, [0-9.]+ s before rank 0 stopped", a["summary"]), a["summary"]
        finally:
            stop(run, sig=signal.SIGKILL, group=True)


def test_the_collective_an_exited_rank_never_joined_comes_from_the_survivors_flight_recorder(tmp_path: Path) -> None:
    # The uneven-data job as seen on H200s: rank 1 gone after all_reduce #25, rank 0 waiting in #26.
    import pickle

    inc = tmp_path / "uneven"
    (inc / "5000").mkdir(parents=True)
    (inc / "5000" / "proc.json").write_text(json.dumps({"pid": 5000, "rank": 0, "world_size": 2, "job": "J"}))
    entries = [{"record_id": i, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
                "profiling_name": "nccl:all_reduce", "input_sizes": [[1024]], "input_dtypes": ["Float"],
                "output_sizes": [[1024]], "state": "started" if seq == 26 else "completed", "is_p2p": False,
                "frames": [{"name": "train_step", "filename": "train.py", "line": 40}]} for i, seq in enumerate((24, 25, 26))]
    (inc / "5000" / "flight-recorder.pkl").write_bytes(pickle.dumps({"version": "2.4", "entries": entries, "pg_status": {
        "0": {"last_enqueued_collective": 26, "last_started_collective": 26, "last_completed_collective": 25}}}))
    (inc / "5001").mkdir()
    t = 1764500000.0
    (inc / "5001" / "exit.json").write_text(json.dumps({"pid": 5001, "rank": 1, "world_size": 2, "status": 0, "time": t,
                                                         "job_hung": {"rank": 0, "pid": 5000, "since": t + 4.5}}))
    out = json.loads(hangwatchd("analyze", str(inc), "--json").stdout)
    clock = time.strftime("%H:%M:%S", time.localtime(t))
    assert out["summary"].startswith(
        f"Rank 1 exited with status 0 at {clock}") and ", 4.5 s before rank 0 stopped; it left after all_reduce #25 " \
        "and never joined all_reduce #26 (process group 0), where rank 0 waits." in out["summary"], out["summary"]
    assert out["culprits"][0]["rank"] == 1 and "after all_reduce #25" in out["culprits"][0]["reason"]
    assert "not on this node" not in out["summary"]  # both ranks are accounted for
