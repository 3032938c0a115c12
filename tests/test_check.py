"""hangwatchd check reports truthfully on this machine."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from hangwatchd.testing import ScratchDaemon

from .conftest import hangwatchd


def test_check_passes_here_and_names_each_part(tmp_path: Path) -> None:
    res = hangwatchd("check", "--json", "--state-dir", str(tmp_path / "s"), "--runtime-dir", str(tmp_path / "r"),
                     "--metrics-address", "127.0.0.1:0")
    checks = {c["name"]: c for c in json.loads(res.stdout)}
    assert set(checks) == {"ptrace", "py-spy", "stack probe", "nvdisasm", "NVML", "kernel log", "cuda-gdb", "state dir",
                           "runtime dir", "dump dir", "metrics port", "inotify"}
    assert checks["py-spy"]["ok"] and "read a test child's stack" in checks["py-spy"]["detail"]
    assert checks["stack probe"]["ok"] and "pystack read a test child" in checks["stack probe"]["detail"]
    # The kernel log names the process behind each XID: root reads /dev/kmsg, a user (dmesg_restrict) is told why not.
    kernel = checks["kernel log"]
    assert not kernel["required"] and (kernel["ok"] or "cannot read /dev/kmsg" in kernel["detail"]), kernel
    if os.geteuid() == 0 and os.path.exists("/dev/kmsg"):
        assert kernel["ok"], kernel
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


def test_check_beside_a_running_daemon_takes_its_port_as_the_daemons(tmp_path: Path) -> None:
    # After `systemctl enable --now`, as the README orders it: the port is the daemon's own.
    with ScratchDaemon(tmp_path) as d:
        address = d.info["metrics_address"]
        res = hangwatchd("check", "--state-dir", str(d.state_dir), "--runtime-dir", str(d.runtime_dir),
                         "--metrics-address", address)
        assert res.returncode == 0, res.stdout
        assert f"ok    metrics port  {address} is in use by the running daemon (pid {d.proc.pid}" in res.stdout
        # The same port checked against another runtime dir (no daemon there) is a conflict.
        res = hangwatchd("check", "--state-dir", str(tmp_path / "s2"), "--runtime-dir", str(tmp_path / "r2"),
                         "--metrics-address", address)
        assert res.returncode == 1 and "FAIL  metrics port" in res.stdout and "not by a hangwatchd daemon" in res.stdout


def test_check_only_looks_it_creates_no_dir(tmp_path: Path) -> None:
    dirs = {"--state-dir": tmp_path / "a" / "state", "--runtime-dir": tmp_path / "b" / "run", "--dump-dir": tmp_path / "c"}
    res = hangwatchd("check", "--json", *[str(x) for kv in dirs.items() for x in kv], "--metrics-address", "127.0.0.1:0")
    checks = {c["name"]: c for c in json.loads(res.stdout)}
    assert res.returncode == 0, res.stdout
    assert checks["state dir"]["ok"] and checks["state dir"]["detail"] == (
        f"{dirs['--state-dir']} does not exist yet; the daemon creates it ({tmp_path} is writable)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing made, not even the parents


def test_check_beside_a_daemon_on_another_port_checks_that_daemon(tmp_path: Path) -> None:
    """No flags but the runtime dir: the running daemon's dirs and its metrics address are checked,
    not the defaults (whose port 9842 is free here, while the daemon serves on another)."""
    with ScratchDaemon(tmp_path) as d:
        address = d.info["metrics_address"]
        assert not address.endswith(":9842")
        res = hangwatchd("check", "--json", "--runtime-dir", str(d.runtime_dir))
        checks = {c["name"]: c for c in json.loads(res.stdout)}
        assert res.returncode == 0, res.stdout
        assert checks["metrics port"]["detail"].startswith(f"{address} is in use by the running daemon (pid {d.proc.pid}")
        assert checks["state dir"]["detail"] == f"{d.state_dir} is writable"
        assert checks["dump dir"]["detail"] == f"{d.dump_dir} is writable"
        # An address given on purpose is checked, and the daemon's own is named beside it.
        res = hangwatchd("check", "--json", "--runtime-dir", str(d.runtime_dir), "--metrics-address", "127.0.0.1:0")
        port = {c["name"]: c for c in json.loads(res.stdout)}["metrics port"]
        assert port["detail"] == f"127.0.0.1:0 is free; the running daemon (pid {d.proc.pid}) serves on {address}"
