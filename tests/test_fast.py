"""Fast where a person waits: the commands import only what they need; evidence is added to an
incident after it is stored; discovery finds a new GPU process within seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import hangwatchd

# What `hangwatchd symbolize` must never load: the daemon's logging, metrics, store, S3 and config.
NOT_FOR_SYMBOLIZE = ("structlog", "prometheus_client", "boto3", "botocore", "sqlite3", "zstandard",
                     "hangwatchd.incidents", "hangwatchd.incidents.store", "hangwatchd.config", "hangwatchd.metrics",
                     "hangwatchd.daemon", "hangwatchd.host.subproc", "subprocess")


def imported(stderr: str) -> set[str]:
    """The modules a ``python -X importtime`` run imported, from its report on stderr."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("as_json", [True, False])
def test_symbolize_imports_only_the_reader(raw_dumps: dict[str, Path], as_json: bool) -> None:
    dump = raw_dumps["cpp_hang"]
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "hangwatchd", "symbolize",
                          *(["--json"] if as_json else []), str(dump)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    mods = imported(res.stderr)
    assert "hangwatchd.cudacore.symbolize" in mods  # the report is what it claims to be
    assert sorted(m for m in NOT_FOR_SYMBOLIZE if m in mods) == []
    if as_json:
        assert json.loads(res.stdout)["kernels"]
    else:
        assert "kernel" in res.stdout.lower()


def test_help_still_names_the_config_defaults() -> None:
    """The defaults in the help text are filled in when help is printed (the config is not imported before)."""
    out = hangwatchd("daemon", "--help").stdout
    assert "(default: /var/lib/hangwatchd)" in " ".join(out.split())
    assert "{default:" not in out


def test_a_bad_dump_is_still_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.nvcudmp"
    bad.write_bytes(b"not a dump")
    res = hangwatchd("symbolize", str(bad))
    assert res.returncode == 2
    assert res.stderr.startswith("hangwatchd: ") and len(res.stderr.strip().splitlines()) == 1


def test_a_store_error_is_still_exit_1(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "index.sqlite").write_bytes(b"garbage that is not a database" * 100)
    res = hangwatchd("incidents", "--state-dir", str(state), "--runtime-dir", str(tmp_path / "run"))
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("hangwatchd: ") and "Traceback" not in res.stderr
