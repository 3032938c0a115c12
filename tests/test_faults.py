"""Faults and load: none stops the loop. Real processes throughout."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangwatchd.incidents.store import Store
from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

from .conftest import hangwatchd


def test_py_spy_missing_is_recorded_and_the_rest_is_captured(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, env={"HANGWATCHD_PYSPY": "none"}, config={"gpu_dump": "never"}) as d:
        work = d.run(workload_argv(beats=3, interval=0.02), "--heartbeat-timeout", "1")
        try:
            (inc,) = wait_for(d.settled, 20, "an incident")
            steps = {s["step"]: s for s in json.loads((Path(inc["dir"]) / "incident.json").read_text())["processes"][0]["steps"]}
            assert steps["proc"]["ok"] and not steps["pyspy"]["ok"]
            assert "py-spy is not installed; pip install py-spy" in steps["pyspy"]["error"]
        finally:
            stop(work, sig=signal.SIGKILL)


def test_no_ptrace_permission_names_what_is_missing(tmp_path: Path) -> None:
    # A process that is not dumpable can be read only with CAP_SYS_PTRACE; capture without it.
    victim = subprocess.Popen([sys.executable, "-c", "import ctypes, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); time.sleep(60)"])
    try:
        time.sleep(0.5)
        res = subprocess.run(["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--",
                              sys.executable, "-m", "hangwatchd", "capture", str(victim.pid), "--json",
                              "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        steps = {s["step"]: s for s in json.loads(res.stdout)["processes"][0]["steps"]}
        assert not steps["pyspy"]["ok"]
        assert "CAP_SYS_PTRACE" in steps["pyspy"]["error"]
    finally:
        stop(victim, sig=signal.SIGKILL)


def test_a_workload_that_forks_and_exits_is_forgotten_not_hung(tmp_path: Path) -> None:
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(30)\n    os._exit(0)\n"
            "print(pid, flush=True)\nos._exit(0)\n")
    with ScratchDaemon(tmp_path, config={"startup_grace": 2.0}) as d:
        work = d.run([sys.executable, "-c", code], "--heartbeat-timeout", "1", stdout=subprocess.PIPE)
        assert work.stdout is not None
        orphan = int(work.stdout.readline())
        try:
            assert work.wait(10) == 0
            # Forgotten at its exit (the event that ends its watching): never hung after that.
            d.event("process_forgotten", why="exited")
            wait_for(lambda: json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)["processes"] == [],
                     10, "the status without it")
            assert d.store().list() == [] and d.metric("hangwatchd_hangs_total", reason="heartbeat") == 0.0
        finally:
            os.kill(orphan, signal.SIGKILL)  # the fork outlives its parent by design; not past the test


def test_sixty_four_watched_and_eight_hanging_at_once(tmp_path: Path) -> None:
    env = dict(os.environ)
    with ScratchDaemon(tmp_path, config={"gpu_dump": "never", "pyspy_native": False}) as d:
        env["HANGWATCHD_RUNTIME_DIR"] = str(d.runtime_dir)
        healthy = [subprocess.Popen(workload_argv(beats=100_000, interval=0.1) + ["--register", "--timeout", "3"], env=env)
                   for _ in range(56)]
        hanging = [subprocess.Popen(workload_argv(beats=40, interval=0.1) + ["--register", "--timeout", "3"], env=env)
                   for _ in range(8)]
        try:
            wait_for(lambda: len(json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)["processes"]) == 64,
                     60, "64 watched", every=0.5)
            incidents = wait_for(lambda: (lambda x: x if len(x) >= 8 else None)(d.settled()), 60, "8 incidents", every=0.5)
            assert sorted(i["processes"][0] for i in incidents) == sorted(p.pid for p in hanging)
            d.looked(56 * 2)  # every healthy one looked at again twice, each look at its 3 s deadline
            assert len(d.store().list()) == 8  # the 56 healthy ones raised nothing
            assert d.metric("hangwatchd_watched_processes", state="healthy") == 56.0
            assert d.proc.poll() is None
        finally:
            stop(*healthy, *hanging, sig=signal.SIGKILL)


def fill(path: Path) -> Path:
    """Fill the file system under path to 0 bytes free; return the filler to delete."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    assert os.statvfs(path).f_bavail == 0
    return filler


def events(d: ScratchDaemon, name: str) -> list[dict[str, object]]:
    return [e for e in d.logs() if e.get("event") == name]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs for the state dir needs root (CI runs as root)")
def test_a_full_state_dir_keeps_the_report_and_stores_it_when_space_returns(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(state)], check=True)
    works: list[subprocess.Popen[bytes]] = []
    try:
        d = ScratchDaemon(tmp_path / "d", "--state-dir", str(state))
        try:
            dirs = ["--state-dir", str(state), "--runtime-dir", str(d.runtime_dir)]
            filler = fill(state)
            works.append(d.run(workload_argv(beats=5, interval=0.02), "--heartbeat-timeout", "1"))
            (spooled,) = wait_for(lambda: events(d, "incident_spooled"), 20, "the report kept in the spool")
            incident_id = str(spooled["incident"])

            # While full: one line each, no traceback; the failure counted; nothing stuck without an incident.
            for argv in (["incidents", *dirs], ["show", incident_id, *dirs]):
                res = hangwatchd(*argv)
                lines = (res.stdout + res.stderr).strip().splitlines()
                assert len(lines) == 1 and "Traceback" not in res.stderr, (argv, res.stdout, res.stderr)
                assert "wait" in lines[0] and "room" in lines[0], lines
            assert d.metric_total("hangwatchd_store_write_failures_total") >= 1
            assert d.metric("hangwatchd_incidents_pending") == 1.0
            def captured() -> dict | None:  # status.json is written off the loop, at most once a second
                (p,) = json.loads(hangwatchd("status", "--json", *dirs).stdout)["processes"]
                return p if p["state"] == "captured" else None
            proc = wait_for(captured, 5, "status.json saying captured")
            assert proc["incident"] == incident_id
            assert Store(state).list() == []

            # Space returns: the report of that hang, with its stuck stack, is stored and listed.
            filler.unlink()
            (inc,) = wait_for(Store(state).list, 20, "the spooled incident stored")
            assert inc["id"] == incident_id and inc["reason"] == "heartbeat" and inc["complete"]
            shown = hangwatchd("show", incident_id, *dirs)
            assert shown.returncode == 0 and "hang_here" in shown.stdout, shown.stdout + shown.stderr
            steps = {s["step"]: s for s in json.loads((Path(inc["dir"]) / "incident.json").read_text())["processes"][0]["steps"]}
            assert steps["pyspy"]["ok"] and steps["cuda_dump"]["skipped"] and "no room" in steps["cuda_dump"]["error"]
            assert wait_for(lambda: d.metric("hangwatchd_incidents_pending") == 0.0, 10, "no report pending")

            # The next hang is stored as usual.
            works.append(d.run(workload_argv(beats=5, interval=0.02), "--heartbeat-timeout", "1"))
            incs = wait_for(lambda: (lambda x: x if len(x) == 2 else None)(Store(state).list()), 20, "a second incident")
            assert "hang_here" in hangwatchd("show", incs[0]["id"], *dirs).stdout
            assert len(events(d, "incident_spooled")) == 1
            assert d.proc.poll() is None
        finally:
            stop(*works, sig=signal.SIGKILL)
            d.stop()
    finally:
        subprocess.run(["umount", "-l", str(state)])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs for the state dir needs root (CI runs as root)")
def test_the_daemon_starts_on_a_full_state_dir_and_every_command_answers_in_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(state)], check=True)
    try:
        ScratchDaemon(tmp_path / "d", "--state-dir", str(state)).stop()  # an index exists, as on any node
        Store(state).open()  # the last connection checkpoints the WAL away: opening it again needs room
        assert not (state / "index.sqlite-wal").exists()
        filler = fill(state)
        with ScratchDaemon(tmp_path / "d", "--state-dir", str(state)) as d:  # a restart while full: up, not exit 2
            victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            try:
                for argv in (["incidents"], ["incidents", "--json"], ["show", "nosuchid"],
                             ["capture", str(victim.pid)]):
                    res = hangwatchd(*argv, "--state-dir", str(state), "--runtime-dir", str(d.runtime_dir))
                    out = (res.stdout + res.stderr).strip().splitlines()
                    assert "Traceback" not in res.stderr and len(out) == 1, (argv, res.stdout, res.stderr)
                    assert res.returncode in (0, 1, 2), (argv, res.returncode)
            finally:
                stop(victim, sig=signal.SIGKILL)
            filler.unlink()
            assert d.proc.poll() is None
    finally:
        subprocess.run(["umount", "-l", str(state)])
