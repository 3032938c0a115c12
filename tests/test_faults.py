"""Faults and load: none stops the loop. Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hangwatchd.testing import Daemon, stop, wait_for, workload_argv

from .conftest import hangwatchd



def test_py_spy_missing_is_recorded_and_the_rest_is_captured(tmp_path: Path) -> None:
    with Daemon(tmp_path, env={"HANGWATCHD_PYSPY": "none"}, config={"gpu_dump": "never"}) as d:
        work = d.run(workload_argv(beats=3, interval=0.02), "--heartbeat-timeout", "1")
        try:
            (inc,) = wait_for(d.store().list, 20, "an incident")
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
        victim.kill()
        victim.wait()


def test_a_workload_that_forks_and_exits_is_forgotten_not_hung(tmp_path: Path) -> None:
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\nos._exit(0)\n"
    with Daemon(tmp_path, config={"startup_grace": 2.0}) as d:
        work = d.run([sys.executable, "-c", code], "--heartbeat-timeout", "1")
        assert work.wait(10) == 0
        time.sleep(4)
        assert d.store().list() == []
        st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
        assert st["processes"] == []


def test_sixty_four_watched_and_eight_hanging_at_once(tmp_path: Path) -> None:
    env = dict(os.environ)
    with Daemon(tmp_path, config={"gpu_dump": "never", "pyspy_native": False}) as d:
        env["HANGWATCHD_RUNTIME_DIR"] = str(d.runtime_dir)
        healthy = [subprocess.Popen(workload_argv(beats=100_000, interval=0.1) + ["--register", "--timeout", "3"], env=env)
                   for _ in range(56)]
        hanging = [subprocess.Popen(workload_argv(beats=40, interval=0.1) + ["--register", "--timeout", "3"], env=env)
                   for _ in range(8)]
        try:
            wait_for(lambda: len(json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)["processes"]) == 64,
                     60, "64 watched", every=0.5)
            incidents = wait_for(lambda: (lambda x: x if len(x) >= 8 else None)(d.store().list()), 60, "8 incidents", every=0.5)
            assert sorted(i["processes"][0] for i in incidents) == sorted(p.pid for p in hanging)
            time.sleep(4)
            assert len(d.store().list()) == 8  # the 56 healthy ones raised nothing
            assert d.metric("hangwatchd_watched_processes", state="healthy") == 56.0
            assert d.proc.poll() is None
        finally:
            stop(*healthy, *hanging, sig=signal.SIGKILL)
