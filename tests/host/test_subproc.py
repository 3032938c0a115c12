"""A tool the daemon runs dies with it: a daemon killed with SIGKILL leaves no py-spy behind,
whether the tool was started through setpriv (vfork, the usual way) or with a preexec_fn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from hangwatchd.host import subproc
from hangwatchd.testing import stop, wait_for

# A stand-in for the daemon: runs a tool that says its pid and sleeps, through subproc.run.
PARENT = textwrap.dedent("""
    import sys
    from hangwatchd.host import subproc
    if sys.argv[2] == "fork":
        subproc._setpriv[:] = [None]
    subproc.run(["sh", "-c", "echo $$ > " + sys.argv[1] + "; exec sleep 60"], timeout=120)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("start", ["setpriv", "fork"])
def test_a_killed_daemon_leaves_no_tool_behind(tmp_path: Path, start: str) -> None:
    if start == "setpriv" and subproc.setpriv() is None:
        pytest.skip("no setpriv on this machine (util-linux): tools are started with a preexec_fn")
    said = tmp_path / "pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(said), start])
    try:
        tool = wait_for(lambda: int(said.read_text()) if said.exists() and said.read_text().strip() else None, 20, "the tool's pid")
        assert psutil.Process(tool).ppid() == parent.pid  # setpriv exec'd the tool: one process, the daemon's child
        assert not _gone(tool)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        wait_for(lambda: _gone(tool), 10, "the tool killed with its daemon")
    finally:
        stop(parent, sig=signal.SIGKILL)
        if said.exists() and said.read_text().strip():
            try:
                os.kill(int(said.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_tool_started_through_setpriv_still_says_what_it_did() -> None:
    res = subproc.run(["sh", "-c", "echo out; echo Error: bad >&2; exit 3"], timeout=10)
    assert (res.returncode, res.stdout, res.stderr_line(), res.argv[0]) == (3, b"out\n", "Error: bad", "sh")
