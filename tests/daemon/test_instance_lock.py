"""One daemon per state dir, whatever its runtime dir (and one per runtime dir, tests/test_daemon.py):
two daemons on one state dir made one dump two incidents."""

from __future__ import annotations

from pathlib import Path

from hangwatchd.testing import ScratchDaemon

from ..conftest import hangwatchd


def test_a_second_daemon_on_the_same_state_dir_with_another_runtime_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path / "first") as first:
        res = hangwatchd("daemon", "--state-dir", str(first.state_dir), "--runtime-dir", str(tmp_path / "other-run"),
                         "--metrics-address", "127.0.0.1:0", timeout=30)
        assert res.returncode == 2 and res.stdout == ""
        (line,) = res.stderr.strip().splitlines()
        assert line == (f"hangwatchd: another daemon (pid {first.proc.pid}, runtime dir {first.runtime_dir}) already uses "
                        f"state dir {first.state_dir}; stop it first or pass another --state-dir")
        assert first.proc.poll() is None
        # The refused one touched nothing: no daemon.json in its runtime dir, the first still answers.
        assert not (tmp_path / "other-run" / "daemon.json").exists()
        assert hangwatchd("status", "--runtime-dir", str(first.runtime_dir)).returncode == 0
    # The lock went with the first: a daemon with another runtime dir now starts on that state dir.
    ScratchDaemon(tmp_path / "second", "--state-dir", str(tmp_path / "first" / "state")).stop()
