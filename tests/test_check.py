"""hangwatchd check reports truthfully on this machine."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from .conftest import hangwatchd


def test_check_passes_here_and_names_each_part(tmp_path: Path) -> None:
    res = hangwatchd("check", "--json", "--state-dir", str(tmp_path / "s"), "--runtime-dir", str(tmp_path / "r"),
                     "--metrics-address", "127.0.0.1:0")
    checks = {c["name"]: c for c in json.loads(res.stdout)}
    assert set(checks) == {"ptrace", "py-spy", "nvdisasm", "NVML", "cuda-gdb", "state dir", "runtime dir",
                           "dump dir", "metrics port", "inotify"}
    assert checks["py-spy"]["ok"] and "read a test child's stack" in checks["py-spy"]["detail"]
    assert checks["nvdisasm"]["ok"]  # the PyPI package is in the test environment
    assert res.returncode == 0, res.stdout


def test_check_fails_on_a_taken_port_and_an_unwritable_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = hangwatchd("check", "--state-dir", str(blocker / "s"), "--runtime-dir", str(tmp_path / "r"),
                         "--metrics-address", f"127.0.0.1:{port}")
    assert res.returncode == 1
    assert "FAIL  metrics port" in res.stdout and "FAIL  state dir" in res.stdout
    assert "cannot run hangwatchd yet: fix state dir" in res.stdout
