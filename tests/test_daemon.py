"""The daemon end to end, with real processes that really stop beating."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.incidents.store import Store
from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, stop, wait_for, workload_argv

from .conftest import hangwatchd

TIMEOUT = 2.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[ScratchDaemon]:
    d = ScratchDaemon(tmp_path)
    yield d
    d.stop()



def test_a_workload_that_stops_beating_becomes_one_incident_with_its_stack(daemon: ScratchDaemon) -> None:
    work = daemon.run(workload_argv(beats=20, interval=0.05), "--job", "train", "--rank", "3",
                      "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
    try:
        assert work.stdout is not None
        assert work.stdout.readline().strip() == b"stopped beating"
        last_beat = time.monotonic()
        store = daemon.store()
        incidents = wait_for(store.list, TIMEOUT + 6, "an incident")
        stored_after = time.monotonic() - last_beat
        assert stored_after < TIMEOUT + 3, stored_after
        (inc,) = incidents
        assert inc["reason"] == "heartbeat" and inc["job"] == "train" and inc["complete"]
        (pid,) = inc["processes"]  # the workload, the launcher's child
        assert pid != work.pid and Path(f"/proc/{pid}").exists()

        shown = hangwatchd("show", inc["id"], "--state-dir", str(daemon.state_dir))
        assert shown.returncode == 0, shown.stderr
        assert "rank 3" in shown.stdout
        user_lines = [ln for ln in shown.stdout.splitlines() if ln.lstrip().startswith("> ")]
        assert user_lines and "hang_here" in user_lines[0] and "testing.py" in user_lines[0]
        steps = {ln.split()[0]: ln.split()[1] for ln in shown.stdout.splitlines() if ln.startswith("    ") and " s" in ln}
        assert steps["proc"] == "ok" and steps["pyspy"] == "ok"
        assert steps["cuda_dump"] == "skipped"  # no GPU wait in the stack: not confirmed

        files = {p.name for p in Path(inc["dir"]).rglob("*") if p.is_file()}
        assert {"incident.json", "proc.json", "pyspy.json", "pyspy-native.json"} <= files
        proc_json = json.loads(next(Path(inc["dir"]).rglob("proc.json")).read_text())
        assert proc_json["rank"] == 3 and proc_json["job"] == "train" and proc_json["hostname"] == socket.gethostname()

        assert daemon.metric("hangwatchd_hangs_total", reason="heartbeat") == 1.0
        assert daemon.metric("hangwatchd_capture_step_duration_seconds_count", step="pyspy") == 1.0
        assert daemon.metric("hangwatchd_watched_processes", state="captured") == 1.0

        def status() -> dict | None:  # status.json is written off the loop, at most once a second
            st = hangwatchd("status", "--json", "--runtime-dir", str(daemon.runtime_dir))
            assert st.returncode == 0, st.stderr
            (p,) = json.loads(st.stdout)["processes"]
            return p if p["state"] == "captured" else None

        p = wait_for(status, 5, "status.json saying captured")
        assert (p["job"], p["rank"], p["state"], p["timeout"]) == ("train", 3, "captured", TIMEOUT)
        assert p["applied_timeout"] == [TIMEOUT, "heartbeat, registration"]
        assert p["last_beat_age"] >= TIMEOUT and p["incident"] == inc["id"]
        table = hangwatchd("status", "--runtime-dir", str(daemon.runtime_dir))
        assert "captured" in table.stdout and "train" in table.stdout

        listing = json.loads(hangwatchd("incidents", "--json", "--state-dir", str(daemon.state_dir)).stdout)
        assert [i["id"] for i in listing] == [inc["id"]]
        # One hang, one incident: the daemon looks at it again (its check is due every TIMEOUT s,
        # the status rewritten each 2 s: the loop's own iterations count them) and declares nothing.
        looked = daemon.metric("hangwatchd_loop_iteration_duration_seconds_count") or 0.0
        wait_for(lambda: (daemon.metric("hangwatchd_loop_iteration_duration_seconds_count") or 0.0) >= looked + 4,
                 20, "the daemon's next looks", every=0.2)
        assert [e for e in daemon.logs() if e.get("event") == "process_hung"] != []
        assert len([e for e in daemon.logs() if e.get("event") == "process_hung"]) == 1
        assert len(store.list()) == 1
    finally:
        stop(work)


def test_a_healthy_workload_raises_nothing_and_an_exited_one_is_forgotten(daemon: ScratchDaemon) -> None:
    healthy = daemon.run(workload_argv(beats=10_000, interval=0.05), "--heartbeat-timeout", "1")
    quick = daemon.run(workload_argv(beats=2, interval=0.01, then="exit"), "--heartbeat-timeout", "1")
    try:
        assert quick.wait(10) == 0
        wait_for(lambda: any(e.get("event") == "process_forgotten" for e in daemon.logs()), 10, "forgetting")
        daemon.looked(3)  # the healthy one looked at again past its 1 s timeout: a look at each deadline
        assert daemon.store().list() == []
        assert daemon.metric("hangwatchd_hangs_total", reason="heartbeat") == 0.0
        st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(daemon.runtime_dir)).stdout)
        assert [p["state"] for p in st["processes"]] == ["healthy"]
        assert not list((daemon.runtime_dir / "registrations").glob("*.json"))[1:]
    finally:
        stop(healthy)


def test_a_workload_that_registers_itself(daemon: ScratchDaemon) -> None:
    env = dict(os.environ, HANGWATCHD_RUNTIME_DIR=str(daemon.runtime_dir))
    work = subprocess.Popen(workload_argv(beats=10, interval=0.05) + ["--register", "--job", "self", "--timeout", "1.5"], env=env)
    try:
        (inc,) = wait_for(daemon.store().list, 15, "an incident")
        assert inc["job"] == "self" and inc["processes"] == [work.pid]
    finally:
        stop(work)


def test_run_exit_status_env_and_warning_without_a_daemon(tmp_path: Path) -> None:
    runtime_dir = tmp_path / "nothing-here"
    script = ("import os,sys; print(os.environ['CUDA_ENABLE_USER_TRIGGERED_COREDUMP'], os.environ['CUDA_COREDUMP_PIPE'],"
              " os.environ['TORCH_NCCL_TRACE_BUFFER_SIZE'], os.environ['TORCH_NCCL_DEBUG_INFO_PIPE_FILE']); sys.exit(7)")
    res = subprocess.run(hangwatchd_argv("run", "--runtime-dir", str(runtime_dir), "--", "python3", "-c", script),
                         capture_output=True, text=True, env=dict(os.environ, TORCH_NCCL_TRACE_BUFFER_SIZE="99"), timeout=30)
    assert res.returncode == 7
    assert res.stderr.count("no daemon is running") == 1
    user_triggered, pipe, trace, fr_pipe = res.stdout.split()
    assert user_triggered == "1" and pipe == str(runtime_dir / "pipes" / "cuda_pipe.%p")
    assert trace == "99"  # what the user set wins
    assert fr_pipe.startswith(str(runtime_dir / "pipes" / "nccl_trace_"))


def test_run_forwards_signals_and_reports_death_by_signal(daemon: ScratchDaemon) -> None:
    work = daemon.run(["python3", "-c", "import signal,time; signal.signal(signal.SIGTERM, lambda *a: exit(42));"
                       " print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert work.stdout is not None and work.stdout.readline() == b"ready\n"
    wait_for(lambda: list((daemon.runtime_dir / "registrations").glob("*.json")), 10, "registration")
    work.send_signal(signal.SIGTERM)
    assert work.wait(10) == 42
    assert not list((daemon.runtime_dir / "registrations").glob("*.json"))  # cleaned up
    killed = daemon.run(["python3", "-c", "import os,signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.wait(10) == 128 + signal.SIGKILL


def test_a_missing_command_is_bad_usage(tmp_path: Path) -> None:
    res = hangwatchd("run", "--runtime-dir", str(tmp_path), "--", "no-such-program-xyz")
    assert res.returncode == 127 and "command not found" in res.stderr
    res = hangwatchd("run", "--runtime-dir", str(tmp_path))
    assert res.returncode == 2 and "no command given" in res.stderr


def test_sd_notify_ready_status_watchdog_stopping(tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(10)
    d = ScratchDaemon(tmp_path / "d", env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"})
    try:
        got: list[str] = []
        while sum(m == "WATCHDOG=1" for m in got) < 3:
            got.append(sock.recv(4096).decode())
        assert "READY=1" in got
        assert got.index("READY=1") < got.index("WATCHDOG=1")
        assert any(m.startswith("STATUS=") for m in got)
        assert d.stop() == 0
        rest = []
        try:
            while True:
                rest.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
        assert "STOPPING=1" in rest
    finally:
        d.stop()
        sock.close()


def test_sigkill_during_a_capture_leaves_an_incomplete_incident_found_at_restart(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "py-spy").write_text("#!/bin/sh\nexec sleep 3600\n")  # a py-spy that hangs
    (fake / "py-spy").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}"}
    d = ScratchDaemon(tmp_path / "d", env=env, config={"pyspy_timeout": 30.0})
    work = d.run(workload_argv(beats=5, interval=0.02), "--heartbeat-timeout", "1")
    try:
        wait_for(lambda: list((d.state_dir / "incidents").glob(".partial-*/*/proc.json")), 15, "capture under way")
        assert d.store().list() == []  # nothing half-written is listed
        d.stop(signal.SIGKILL)
        d2 = ScratchDaemon(tmp_path / "d", env=env)
        try:
            (inc,) = d2.store().list()
            assert inc["complete"] is False
            (pid,) = inc["processes"]
            assert (Path(inc["dir"]) / str(pid) / "proc.json").exists()
            shown = hangwatchd("show", inc["id"], "--state-dir", str(d2.state_dir))
            assert shown.returncode == 0 and "INCOMPLETE" in shown.stdout
            assert any(e.get("event") == "incident_recovered" for e in d2.logs())
        finally:
            d2.stop()
    finally:
        stop(work)
        d.stop()


def _status_of(d: ScratchDaemon, pid: int) -> dict[str, Any]:
    st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
    (p,) = [p for p in st["processes"] if p["pid"] == pid]
    return p


@pytest.mark.parametrize("how", ["a clean stop after the capture", "kill -9 during the capture"])
def test_a_restarted_daemon_adopts_a_hang_it_stored_and_never_declares_it_again(tmp_path: Path, how: str) -> None:
    """The process still hangs after the restart: it is watched as captured (by its incident), no
    second incident and no second hang are counted; when it beats again it is healthy, and a new
    hang after that is a new incident."""
    base = tmp_path / "d"
    stalls = tmp_path / "stall"
    code = ("import os, time, hangwatchd\n"
            f"stall = {str(stalls)!r}\n"
            "while True:\n"
            "    hangwatchd.beat()\n"
            "    time.sleep(0.05)\n"
            "    while os.path.exists(stall):\n"
            "        time.sleep(0.05)\n")
    env, slow = {}, None
    if how.startswith("kill"):
        fake = tmp_path / "bin"  # a py-spy that hangs: the capture is under way when the daemon is killed
        fake.mkdir()
        (fake / "py-spy").write_text("#!/bin/sh\nexec sleep 3600\n")
        (fake / "py-spy").chmod(0o755)
        env, slow = {"PATH": f"{fake}:{os.environ['PATH']}"}, {"pyspy_timeout": 30.0}
    d = ScratchDaemon(base, env=env, config={"gpu_dump": "never", **(slow or {})})
    stalls.touch()
    work = d.run([sys.executable, "-c", code], "--heartbeat-timeout", "1")
    d2 = None
    try:
        if slow:
            wait_for(lambda: list((d.state_dir / "incidents").glob(".partial-*/*/proc.json")), 20, "capture under way")
            d.stop(signal.SIGKILL)
        else:
            wait_for(d.settled, 20, "the incident")
            d.stop()
        d2 = ScratchDaemon(base, config={"gpu_dump": "never"})
        (first,) = wait_for(d2.store().list, 10, "the first incident, recovered or stored")
        workload_pid = first["processes"][0]
        wait_for(lambda: _status_of(d2, workload_pid)["state"] == "captured", 10, "the hang adopted as captured")
        assert _status_of(d2, workload_pid)["incident"] == first["id"]
        d2.looked(3, after=time.time() + 3)  # three times its timeout, looked at again and again
        assert [i["id"] for i in d2.store().list()] == [first["id"]]
        assert not d2.metric("hangwatchd_hangs_total", reason="heartbeat")
        stalls.unlink()  # it beats again: healthy
        wait_for(lambda: _status_of(d2, workload_pid)["state"] == "healthy", 10, "its recovery")
        stalls.touch()  # and a new hang is a new incident
        wait_for(lambda: len(d2.store().list()) == 2, 20, "the second hang's incident")
    finally:
        stop(work)
        if d2 is not None:
            d2.stop()
        d.stop()


def test_a_hanging_py_spy_is_killed_at_its_deadline(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    pids = tmp_path / "pyspy.pids"  # each fake py-spy's pid: checked by pid, never by name
    (fake / "py-spy").write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 3601\n")
    (fake / "py-spy").chmod(0o755)
    d = ScratchDaemon(tmp_path / "d", env={"PATH": f"{fake}:{os.environ['PATH']}"}, config={"pyspy_timeout": 1.0, "pyspy_native": False})
    work = d.run(workload_argv(beats=5, interval=0.02), "--heartbeat-timeout", "1")
    try:
        (inc,) = wait_for(d.settled, 15, "an incident")
        data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
        steps = {s["step"]: s for s in data["processes"][0]["steps"]}
        assert steps["proc"]["ok"] is True
        assert steps["pyspy"]["ok"] is False and "killed" in steps["pyspy"]["error"]
        assert steps["pyspy"]["seconds"] < 5
        assert d.metric("hangwatchd_capture_step_failures_total", step="pyspy") == 1.0
        started = [int(p) for p in pids.read_text().split()]
        assert started and not [p for p in started if Path(f"/proc/{p}").exists()]  # killed with its group, and reaped
    finally:
        stop(work)
        d.stop()



# -- one daemon per runtime dir, signals, restarts ----------------------------

def test_a_second_daemon_on_the_same_runtime_dir_exits_2_naming_the_first(daemon: ScratchDaemon) -> None:
    res = hangwatchd("daemon", "--state-dir", str(daemon.base / "state2"), "--runtime-dir", str(daemon.runtime_dir),
                     "--metrics-address", "127.0.0.1:0", timeout=30)
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert f"pid {daemon.proc.pid}" in line and str(daemon.runtime_dir) in line
    st = hangwatchd("status", "--runtime-dir", str(daemon.runtime_dir))
    assert st.returncode == 0 and daemon.proc.poll() is None  # the first one still looks alive


def test_sighup_stops_the_daemon_cleanly(tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    try:
        d = ScratchDaemon(tmp_path / "d", env={"NOTIFY_SOCKET": str(sock_path)})
        d.proc.send_signal(signal.SIGHUP)
        assert d.proc.wait(20) == 0
        assert not (d.runtime_dir / "daemon.json").exists() and not (d.runtime_dir / "status.json").exists()
        got = []
        while True:
            try:
                got.append(sock.recv(4096).decode())
            except TimeoutError:
                break
        assert "READY=1" in got and got[-1] == "STOPPING=1", got
        assert d.stop() == 0
        # The lock went with it: the next daemon starts on the same runtime dir.
        ScratchDaemon(tmp_path / "d").stop()
    finally:
        sock.close()


def raw_dump(dump_dir: Path, pid: int) -> Path:
    import lzma

    from .conftest import FIXTURES

    path = dump_dir / f"core_{socket.gethostname()}.{pid}.1.nvcudmp"
    tmp = dump_dir / f".{path.name}.tmp"
    tmp.write_bytes(lzma.decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes()))
    tmp.replace(path)
    return path


def test_a_dump_written_while_the_daemon_was_down_is_ingested_at_start_and_only_once(tmp_path: Path) -> None:
    ScratchDaemon(tmp_path).stop()
    dump_dir = tmp_path / "state-dumps"
    dump = raw_dump(dump_dir, 4242)
    with ScratchDaemon(tmp_path) as d:
        (inc,) = wait_for(d.settled, 30, "the dump made into an incident")
        assert inc["reason"] == "gpu-exception" and inc["processes"] == [4242]
        assert "WARP_ILLEGAL_ADDRESS" in inc["summary"]
    # The same dump again (restored from a backup, say): remembered across the restart, not ingested twice.
    raw_dump(dump_dir, 4242)
    d = ScratchDaemon(tmp_path)
    d.event("daemon_ready")  # the dump dir was scanned before it
    d.stop()  # and a capture handed out at start would have finished: stopping waits for every one
    assert len(d.store().list()) == 1
    assert dump.exists()


def test_an_inotify_overflow_rescans_registrations_and_dumps(tmp_path: Path) -> None:
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    with ScratchDaemon(tmp_path, config={"rescan_interval": 3600.0}) as d:
        noise = d.runtime_dir / "registrations"
        d.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(limit // 2 + 500):  # CREATE and CLOSE_WRITE each: past the queue's limit
                (noise / f".noise-{i}").touch()
            raw_dump(d.dump_dir, 4343)  # its event is one of those dropped
        finally:
            d.proc.send_signal(signal.SIGCONT)
        (inc,) = wait_for(d.settled, 30, "the dump found by the rescan")
        assert inc["processes"] == [4343]
        assert any(e.get("event") == "inotify_overflow" for e in d.logs())


# -- one hang, one incident ---------------------------------------------------

WOBBLE = """
import sys, time, hangwatchd
def a(): time.sleep(0.2)
def b(): time.sleep(0.2)
for _ in range(10):
    hangwatchd.beat(); time.sleep(0.05)
print("silent", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:  # no beats, but the stack keeps moving
    a(); b()
print("beating again", flush=True)
for _ in range(20):
    hangwatchd.beat(); time.sleep(0.05)
print("stopped", flush=True)
while True:
    time.sleep(3600)
"""


def test_a_captured_hang_rearms_only_after_the_process_beats_again(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config={"stack_interval": 0.5, "gpu_dump": "never"}) as d:
        work = d.run([sys.executable, "-c", WOBBLE, "12"], "--heartbeat-timeout", "1", "--stack-timeout", "60",
                     stdout=subprocess.PIPE)
        try:
            assert work.stdout is not None
            assert work.stdout.readline().strip() == b"silent"
            assert work.stdout.readline().strip() == b"beating again"
            # Twelve silent seconds with a moving stack: one hang, one incident.
            assert len(d.store().list()) == 1
            assert work.stdout.readline().strip() == b"stopped"
            incs = wait_for(lambda: (lambda x: x if len(x) == 2 else None)(d.settled()), 15, "the second hang's incident")
            assert all(i["reason"] == "heartbeat" for i in incs)
            recovered = [e for e in d.logs() if e.get("event") == "process_recovered"]
            assert len(recovered) == 1 and "new beats" in str(recovered[0]["why"])
            d.looked(4)  # looked at again past its 1 s timeout while it stays silent: captured, not declared again
            assert len(d.store().list()) == 2
        finally:
            stop(work)


# -- the loop never dies of one process's trouble ------------------------------

def test_a_beat_file_swapped_for_a_directory_does_not_stop_the_loop(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path) as d:
        victim = d.run(workload_argv(beats=100_000, interval=0.05), "--heartbeat-timeout", "5")
        try:
            beat = wait_for(lambda: list((d.runtime_dir / "beats").glob("run-*.beat")), 10, "the beat segment")[0]
            wait_for(lambda: json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)["processes"],
                     10, "the workload watched")
            beat.unlink()
            beat.mkdir()
            work = d.run(workload_argv(beats=5, interval=0.02), "--heartbeat-timeout", "1", stdout=subprocess.PIPE)
            try:
                assert work.stdout is not None and work.stdout.readline().strip() == b"stopped beating"
                started = time.monotonic()
                incs = wait_for(lambda: [i for i in d.settled() if i["processes"][0] != victim.pid
                                         and "hang_here" in hangwatchd("show", i["id"], "--state-dir", str(d.state_dir)).stdout],
                                15, "the real hang's incident")
                assert time.monotonic() - started < 1 + 6 and incs
                assert d.proc.poll() is None
            finally:
                stop(work)
        finally:
            stop(victim)
            if beat.is_dir():
                beat.rmdir()


# -- hangwatchd run's workload dies with it ------------------------------------

def test_a_killed_hangwatchd_run_takes_its_workload_with_it(tmp_path: Path) -> None:
    run = subprocess.Popen(hangwatchd_argv("run", "--runtime-dir", str(tmp_path / "run"), "--",
                                           sys.executable, "-c", "import time; time.sleep(3600)"),
                           stderr=subprocess.DEVNULL)
    children = Path(f"/proc/{run.pid}/task/{run.pid}/children")
    (child,) = wait_for(lambda: [int(p) for p in children.read_text().split()], 20, "the workload started")
    run.kill()
    run.wait()
    wait_for(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split(")")[1][:3],
             5, "the workload gone")


def test_two_demos_at_once_run_in_their_own_directories_and_keep_earlier_runs(tmp_path: Path) -> None:
    # A short base: the demo's notify socket path must fit in sockaddr_un's 108 bytes.
    short = Path(tempfile.mkdtemp(prefix="hwd-", dir="/tmp"))
    try:
        two_demos(short)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def two_demos(tmp_path: Path) -> None:
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path))
    demos = [subprocess.Popen([sys.executable, "-m", "hangwatchd.demo"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].decode() for p in demos]
    assert [p.returncode for p in demos] == [0, 0], outs
    runs = sorted((tmp_path / "hangwatchd-demo").iterdir())
    assert len(runs) == 2
    for r in runs:
        assert len(Store(r / "state").list()) == 1  # each its own incident, neither wiped by the other
