"""Config errors name the key, the value and what is allowed; exit status 2, one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatchd import config

from .conftest import hangwatchd


def daemon_with(tmp_path: Path, text: str, *extra: str) -> str:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    res = hangwatchd("daemon", "--config", str(cfg), "--state-dir", str(tmp_path / "s"),
                     "--runtime-dir", str(tmp_path / "r"), "--metrics-address", "", *extra, timeout=30)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    return lines[0]


def test_unknown_key(tmp_path: Path) -> None:
    line = daemon_with(tmp_path, 'heartbeat_timout = 5\n')
    assert "unknown key 'heartbeat_timout'" in line and "heartbeat_timeout" in line


def test_bad_value(tmp_path: Path) -> None:
    line = daemon_with(tmp_path, 'heartbeat_timeout = -1\n')
    assert "'heartbeat_timeout' = -1" in line and "greater than 0" in line


def test_bad_steps_and_address(tmp_path: Path) -> None:
    assert "capture_steps" in daemon_with(tmp_path, 'capture_steps = ["proc", "gdb"]\n')
    assert "HOST:PORT" in daemon_with(tmp_path, 'metrics_address = "nowhere"\n')


def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    assert "not valid TOML" in daemon_with(tmp_path, "this is = = not toml")
    res = hangwatchd("daemon", "--config", str(tmp_path / "none.toml"))
    assert res.returncode == 2 and "no such file" in res.stderr


def test_a_runtime_dir_that_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = hangwatchd("daemon", "--state-dir", str(tmp_path / "s"), "--runtime-dir", str(blocker / "run"),
                     "--metrics-address", "", timeout=30)
    assert res.returncode == 2, res.stderr
    assert str(blocker / "run") in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_flags_override_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('heartbeat_timeout = 9\nstate_dir = "/a"\n')
    c = config.load(cfg, {"heartbeat_timeout": 3.0, "state_dir": None})
    assert c.heartbeat_timeout == 3.0 and c.state_dir == "/a" and c.dumps == Path("/a/dumps")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_fuzz_config_text(text: str) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        config.load(f.name)
    except config.ConfigError as exc:
        assert f.name in str(exc)
    finally:
        Path(f.name).unlink()


@pytest.mark.parametrize("key", list(config.KEYS))
def test_every_default_passes_its_own_check(key: str) -> None:
    assert config.KEYS[key].check(config.KEYS[key].default) is None
