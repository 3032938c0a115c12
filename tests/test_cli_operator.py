"""What an operator meets in the first week with the command line: output piped into head, the
running daemon's dirs found by every command, `show`'s grammar, a stopped daemon, a damaged file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatchd.testing import ScratchDaemon, stop, wait_for

from .conftest import FIXTURES, extract, hangwatchd

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def captured(tmp_path: Path) -> Iterator[tuple[Path, str, int]]:
    """A real incident, taken by hand (`hangwatchd capture`) of a sleeping process: (state dir, id, pid)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\ndef nap():\n    time.sleep(600)\nnap()"])
    try:
        wait_for(lambda: Path(f"/proc/{sleeper.pid}/wchan").read_text() not in ("", "0"), 10, "the sleeper asleep")
        res = hangwatchd("capture", str(sleeper.pid), "--json", "--state-dir", str(tmp_path / "state"),
                         "--runtime-dir", str(tmp_path / "run"))
    finally:
        stop(sleeper)
    assert res.returncode == 0, res.stderr
    yield tmp_path / "state", json.loads(res.stdout)["id"], sleeper.pid


def closed_pipe_run(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with its stdout a pipe whose reader has gone, as `| head` leaves it once it has its lines."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "hangwatchd", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)


def test_json_into_a_reader_that_left_ends_quietly(tmp_path: Path, captured: tuple[Path, str, int]) -> None:
    state, incident, _pid = captured
    extract(ROOT / "tests" / "fixtures" / "h200-diverged" / "incident.tar.xz", tmp_path / "h200")
    (by_hand,) = [p.parent for p in (tmp_path / "h200").rglob("incident.json")]
    for args in (["check", "--json", "--state-dir", str(tmp_path / "s"), "--runtime-dir", str(tmp_path / "r"),
                  "--metrics-address", "127.0.0.1:0"],
                 ["incidents", "--json", "--state-dir", str(state)],
                 ["show", "--json", incident, "--state-dir", str(state)],
                 ["analyze", "--json", str(by_hand)],
                 ["symbolize", "--json", str(FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz")]):
        res = closed_pipe_run(*args)
        assert (res.returncode, res.stderr) == (0, ""), f"{args[0]}: {res.returncode} {res.stderr[-600:]}"
    # The same through a real `head`, with output larger than the pipe holds.
    shell = subprocess.run(f"{sys.executable} -m hangwatchd symbolize --json {FIXTURES / 'torch_ima' / 'coredump.nvcudmp.xz'}"
                           " | head -c 10 >/dev/null; echo ${PIPESTATUS[0]}",
                           shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert (shell.stdout.strip(), shell.stderr) == ("0", "")


def test_show_takes_its_id_and_html_file_in_either_order(tmp_path: Path, captured: tuple[Path, str, int]) -> None:
    state, incident, _pid = captured
    st = ["--state-dir", str(state)]
    page = tmp_path / "page.html"
    for args, written in ((["show", incident, "--html", str(page)], page),
                          (["show", "--html", str(tmp_path / "other.html"), incident], tmp_path / "other.html"),
                          (["show", "--html", incident], tmp_path / f"hangwatchd-{incident}.html"),
                          (["show", incident, "--html"], tmp_path / f"hangwatchd-{incident}.html")):
        written.unlink(missing_ok=True)
        res = subprocess.run([sys.executable, "-m", "hangwatchd", *args, *st], capture_output=True, text=True, cwd=tmp_path,
                             timeout=60)
        assert res.returncode == 0, (args, res.stderr)
        assert Path(tmp_path, res.stdout.strip()) == written and f"Incident {incident}" in written.read_text(), args
    res = hangwatchd("show", "--html", *st)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "give the incident's ID" in res.stderr


def test_show_says_a_truncated_stack_file_is_damaged_not_ok(captured: tuple[Path, str, int]) -> None:
    state, incident, pid = captured
    (pdir,) = [p for p in (state / "incidents").glob(f"*/{pid}")]
    for name in ("pyspy-native.json", "pyspy.json"):
        f = pdir / name
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # cut, as a full disk or a crash leaves it
    text = hangwatchd("show", incident, "--state-dir", str(state)).stdout
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("pyspy ")]
    assert "DAMAGED" in line and "ok when captured, but pyspy-native.json is damaged: not JSON" in line, line
    assert "pyspy.json is damaged" in line
    proc = next(ln for ln in text.splitlines() if ln.strip().startswith("proc "))
    assert " ok " in proc  # the others stay as they were
    data = json.loads(hangwatchd("show", "--json", incident, "--state-dir", str(state)).stdout)
    steps = {s["step"]: s for s in data["processes"][0]["steps"]}
    assert steps["pyspy"]["ok"] and steps["pyspy"]["damaged"] and "damaged" not in steps["proc"]


def test_capture_stores_into_the_running_daemons_state_dir(tmp_path: Path) -> None:
    """Like status, capture finds the running daemon through its daemon.json in the runtime dir."""
    with ScratchDaemon(tmp_path / "d") as d:
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            res = hangwatchd("capture", str(sleeper.pid), "--json", env={"HANGWATCHD_RUNTIME_DIR": str(d.runtime_dir)})
        finally:
            stop(sleeper)
        assert res.returncode == 0, res.stderr
        incident = json.loads(res.stdout)["id"]
        assert [i["id"] for i in d.store().list()] == [incident]
        listed = hangwatchd("incidents", "--json", env={"HANGWATCHD_RUNTIME_DIR": str(d.runtime_dir)})
        assert [i["id"] for i in json.loads(listed.stdout)] == [incident]


def test_status_says_when_the_daemon_is_not_running(tmp_path: Path) -> None:
    d = ScratchDaemon(tmp_path / "d")
    run = ["--runtime-dir", str(d.runtime_dir)]
    try:
        ok = hangwatchd("status", *run)
        assert (ok.returncode, ok.stderr) == (0, "") and ok.stdout.startswith("hangwatchd ")
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            held = hangwatchd("status", *run)
            as_json = hangwatchd("status", "--json", *run)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert held.returncode == 1 and held.stderr.count("\n") == 1, held.stderr
        assert held.stderr.startswith(f"hangwatchd: the daemon (pid {d.proc.pid}) is not running: it is stopped")
        assert "this is what it wrote at " in held.stderr and " s ago" in held.stderr
        assert "PID" in held.stdout  # the old picture still shown, after the warning
        assert as_json.returncode == 1 and json.loads(as_json.stdout)["daemon_running"] is False
    finally:
        d.stop(signal.SIGKILL)  # killed: its daemon.json and status.json stay behind
    gone = hangwatchd("status", *run)
    assert gone.returncode == 1 and gone.stdout == "" and gone.stderr.count("\n") == 1, gone.stderr
    assert f"no daemon is running with runtime dir {d.runtime_dir} (the last daemon's status was written at " in gone.stderr
