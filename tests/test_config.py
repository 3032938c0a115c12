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
    assert line.endswith("unknown key 'heartbeat_timout'; did you mean 'heartbeat_timeout'?"), line
    # The nearest keys only, never all of them.
    line = daemon_with(tmp_path, 'stack_timeout = 5\n')
    assert "did you mean 'stack_timeouts'" in line and "state_dir" not in line and len(line) < 200, line
    line = daemon_with(tmp_path, 'zzz = 5\n')
    assert line.endswith("unknown key 'zzz'; config/hangwatchd.toml lists every key with its default"), line


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
    assert c.heartbeat_timeout == 3.0 and c.state_dir == "/a" and c.dumps == Path("/a-dumps")


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


@pytest.mark.parametrize("text, key, value", [
    ('max_state_bytes = "50GiB"\n', "max_state_bytes", 50 * 2**30),
    ('max_state_bytes = "10G"\n', "max_state_bytes", 10 * 2**30),
    ('max_state_bytes = "500MB"\n', "max_state_bytes", 500 * 10**6),
    ("max_state_bytes = 1073741824\n", "max_state_bytes", 2**30),
    ('heartbeat_timeout = "10m"\n', "heartbeat_timeout", 600.0),
    ('pyspy_timeout = "500ms"\n', "pyspy_timeout", 0.5),
    ("heartbeat_timeout = 45\n", "heartbeat_timeout", 45.0),
    ('dump_max_age_days = "12h"\n', "dump_max_age_days", 0.5),
    ("dump_max_age_days = 3\n", "dump_max_age_days", 3.0),
    ('stack_timeouts = { "vllm" = "15m" }\n', "stack_timeouts", {"vllm": 900.0}),
])
def test_sizes_and_durations_take_units(tmp_path: Path, text: str, key: str, value: object) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    assert getattr(config.load(cfg), key) == value


@pytest.mark.parametrize("text, wanted", [
    ('max_state_bytes = "10 parsecs"\n', "a size in bytes"),
    ('max_state_bytes = "lots"\n', "a size in bytes"),
    ('heartbeat_timeout = "10G"\n', "a number of seconds"),
    ('heartbeat_timeout = "soon"\n', "a number of seconds"),
    ('dump_max_age_days = "forever"\n', "a number of days"),
    ("learn_min_beats = 2.5\n", "a whole number"),
    ("learned_timeout_factor = 0\n", "a number greater than 0"),
])
def test_each_message_names_the_right_unit(tmp_path: Path, text: str, wanted: str) -> None:
    line = daemon_with(tmp_path, text)
    assert wanted in line, line
    assert ("seconds" in line) == ("seconds" in wanted), line  # a size is never blamed for not being seconds


@pytest.mark.parametrize("text", ["heartbeat_timeout = inf\n", "heartbeat_timeout = nan\n", "max_state_bytes = inf\n",
                                  "learned_timeout_factor = nan\n", "dump_max_age_days = inf\n"])
def test_inf_and_nan_are_refused(tmp_path: Path, text: str) -> None:
    line = daemon_with(tmp_path, text)
    assert f"'{text.split()[0]}'" in line and "is not allowed" in line


def test_learned_minimum_above_maximum_is_refused(tmp_path: Path) -> None:
    line = daemon_with(tmp_path, "learned_timeout_min = 600\nlearned_timeout_max = \"5m\"\n")
    assert "learned_timeout_min = 600 s is more than learned_timeout_max = 300 s" in line


def test_a_bad_metrics_host_is_blamed_on_the_metrics_address(tmp_path: Path) -> None:
    line = daemon_with(tmp_path, "", "--metrics-address", "no-such-host.invalid:9842")
    assert line.startswith("hangwatchd: metrics address no-such-host.invalid:9842 cannot be served"), line
    assert str(tmp_path / "r") not in line and "--metrics-address" in line


def test_the_daemon_flag_takes_a_duration(tmp_path: Path) -> None:
    line = daemon_with(tmp_path, "", "--heartbeat-timeout", "forever")
    assert "--heartbeat-timeout" in line and "'forever'" in line and "number of seconds" in line
