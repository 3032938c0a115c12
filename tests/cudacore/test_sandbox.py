"""A hostile dump costs one limited child and one line, never a worker: crafted line
tables, a FIFO named like a dump, a dump too big to map, a child that allocates or hangs,
and the daemon filing the line in the incident and symbolising the next dump as usual."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatchd.cudacore import sandbox
from hangwatchd.cudacore.errors import CoreDumpError
from hangwatchd.cudacore.sandbox import Limits, SymbolizeStopped
from hangwatchd.testing import ScratchDaemon, wait_for

from . import hostile

# Generous over the limits: the machine running the suite is shared and loaded.
SLACK_S = 10.0


@pytest.fixture(scope="module", autouse=True)
def fork_server() -> Iterator[None]:
    sandbox.start()
    yield
    sandbox.stop()


def timed(path: Path, limits: Limits, **kw: object) -> tuple[object, float]:
    """(the Symbolized, or the exception it raised; seconds it took)."""
    start = time.monotonic()
    try:
        out: object = sandbox.symbolize(path, limits, **kw)  # type: ignore[arg-type]  # the keywords a test passes through, as the caller gives them
    except CoreDumpError as exc:
        out = exc
    return out, time.monotonic() - start


def still_symbolises(raw_dumps: dict[str, Path]) -> None:
    """A real dump right after: the exception, the kernel and the whole chain, as ever."""
    out = sandbox.symbolize(raw_dumps["cpp_ima"], Limits())
    (e,) = out.exceptions
    assert e.type == "WARP_ILLEGAL_ADDRESS" and e.kernel == "faulty_epilogue_kernel(int*, long)"
    assert [f.line for f in e.frames] == [9, 13, 17] and e.frames_from == "line-table"


def test_a_1mb_line_table_of_one_endless_leb128_is_one_note_in_well_under_its_limit(
        raw_dumps: dict[str, Path], tmp_path: Path) -> None:
    dump = tmp_path / "leb.nvcudmp"
    dump.write_bytes(hostile.hostile_dump(raw_dumps["cpp_ima"].read_bytes(), hostile.endless_leb128(1 << 20)))
    limits = Limits(cpu_seconds=5, memory_mb=2048, wall_seconds=30)
    out, seconds = timed(dump, limits)
    # Before: 320 KB of such a number took 4.4 s, 1 MB about 45 s, in a capture worker.
    assert seconds < limits.cpu_seconds + SLACK_S
    assert not isinstance(out, Exception), out
    assert any("line table cannot be read" in n and "LEB128" in n for n in out.notes), out.notes  # type: ignore[attr-defined]  # a Symbolized: the sandbox returned one
    (e,) = out.exceptions  # type: ignore[attr-defined]  # a Symbolized: the sandbox returned one
    assert e.type == "WARP_ILLEGAL_ADDRESS" and e.frames_from != "line-table"
    still_symbolises(raw_dumps)


def test_a_1mb_line_table_of_a_million_rows_is_read_within_the_cpu_limit(
        raw_dumps: dict[str, Path], tmp_path: Path) -> None:
    dump = tmp_path / "rows.nvcudmp"
    dump.write_bytes(hostile.hostile_dump(raw_dumps["cpp_ima"].read_bytes(), hostile.many_rows(1 << 20)))
    limits = Limits(cpu_seconds=20, memory_mb=2048, wall_seconds=60)
    out, seconds = timed(dump, limits, nvdisasm=None)
    assert not isinstance(out, Exception), out
    assert seconds < limits.cpu_seconds + SLACK_S
    # Its rows hold none of the warps' PCs: said, not silently answered by something else.
    assert any("no row of its line table holds it" in n for n in out.notes), out.notes  # type: ignore[attr-defined]  # a Symbolized: the sandbox returned one


def test_a_dump_that_needs_more_cpu_than_allowed_costs_one_killed_child_and_one_line(
        raw_dumps: dict[str, Path], tmp_path: Path) -> None:
    dump = tmp_path / "slow.nvcudmp"
    dump.write_bytes(hostile.hostile_dump(raw_dumps["cpp_ima"].read_bytes(), hostile.many_rows(3 << 20)))
    limits = Limits(cpu_seconds=1, memory_mb=2048, wall_seconds=60)
    out, seconds = timed(dump, limits, nvdisasm=None)
    assert isinstance(out, SymbolizeStopped), out
    assert str(out) == f"{dump}: symbolising stopped: CPU limit of 1 s"
    assert seconds < limits.cpu_seconds + 1 + SLACK_S
    still_symbolises(raw_dumps)


def test_a_fifo_named_like_a_dump_is_refused_at_once(raw_dumps: dict[str, Path], tmp_path: Path) -> None:
    fifo = tmp_path / f"core_{socket.gethostname()}.4242.1700000000.nvcudmp"
    os.mkfifo(fifo)
    limits = Limits(cpu_seconds=5, memory_mb=1024, wall_seconds=10)
    out, seconds = timed(fifo, limits)
    assert isinstance(out, CoreDumpError) and not isinstance(out, SymbolizeStopped), out
    assert str(out) == f"{fifo}: not a regular file (a FIFO, device or socket), so not a CUDA coredump"
    assert seconds < SLACK_S
    still_symbolises(raw_dumps)


def test_a_dump_too_big_for_the_memory_limit_costs_one_child_and_one_line(
        raw_dumps: dict[str, Path], tmp_path: Path) -> None:
    big = tmp_path / "big.nvcudmp"
    with open(big, "wb") as f:
        f.write(raw_dumps["cpp_ima"].read_bytes())
        f.truncate(2 << 30)  # sparse: 2 GiB claimed, a few hundred KB on disk
    out, seconds = timed(big, Limits(cpu_seconds=10, memory_mb=256, wall_seconds=30))
    assert isinstance(out, SymbolizeStopped), out
    assert str(out) == f"{big}: symbolising stopped: memory limit of 256 MB"
    assert seconds < 10 + SLACK_S
    still_symbolises(raw_dumps)


def test_a_child_that_allocates_without_end_is_stopped_at_the_memory_limit(raw_dumps: dict[str, Path]) -> None:
    out, seconds = timed(raw_dumps["cpp_ima"], Limits(cpu_seconds=30, memory_mb=512, wall_seconds=60), _hook="allocate")
    assert isinstance(out, SymbolizeStopped), out
    assert str(out).endswith("symbolising stopped: memory limit of 512 MB")
    assert seconds < 30 + SLACK_S
    still_symbolises(raw_dumps)


def test_a_child_that_hangs_is_killed_at_the_wall_deadline_with_its_group(
        raw_dumps: dict[str, Path], tmp_path: Path) -> None:
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="hangwatchd-sandbox-"))  # the child is not root: it writes where anyone may
    os.chmod(where, 0o1777)
    pidfile = where / "grandchild.pid"
    out, seconds = timed(raw_dumps["cpp_ima"], Limits(cpu_seconds=30, memory_mb=1024, wall_seconds=2),
                         _hook=f"sleep:{pidfile}")
    assert isinstance(out, SymbolizeStopped), out
    assert str(out).endswith("symbolising stopped: wall-clock limit of 2 s")
    assert 2 <= seconds < 2 + SLACK_S
    grandchild = int(pidfile.read_text())
    pidfile.unlink()
    where.rmdir()

    def gone() -> bool:
        try:
            return Path(f"/proc/{grandchild}/stat").read_text().split(") ")[1][0] == "Z"
        except (FileNotFoundError, ProcessLookupError):
            return True

    wait_for(gone, 10, "the child's own child to be killed with its group")
    still_symbolises(raw_dumps)


def test_the_daemon_files_one_line_for_a_dump_over_the_cpu_limit_and_symbolises_the_next(
        raw_dumps: dict[str, Path], tmp_path: Path) -> None:
    host = socket.gethostname()
    slow = hostile.hostile_dump(raw_dumps["cpp_ima"].read_bytes(), hostile.many_rows(3 << 20))
    with ScratchDaemon(tmp_path / "d", config={"symbolize_cpu_seconds": 1, "symbolize_timeout": 30}) as d:
        dumps = d.dump_dir

        def drop(name: str, data: bytes) -> None:
            part = dumps / (name + ".part")
            part.write_bytes(data)
            part.rename(dumps / name)  # as the driver would: the name appears complete

        start = time.monotonic()
        drop(f"core_{host}.77.1700000000.nvcudmp", slow)
        (first,) = wait_for(lambda: d.store().list(), 1 + 2 * SLACK_S, "the hostile dump's incident")
        seconds = time.monotonic() - start
        assert "symbolising stopped: CPU limit of 1 s" in first["summary"], first
        assert seconds < 1 + 2 * SLACK_S
        drop(f"core_{host}.78.1700000001.nvcudmp", raw_dumps["cpp_ima"].read_bytes())
        both = wait_for(lambda: (lambda xs: xs if len(xs) == 2 else None)(d.store().list()), 2 * SLACK_S,
                        "the real dump's incident")
        second = next(i for i in both if i["id"] != first["id"])
        assert second["summary"].startswith("gpu-exception: WARP_ILLEGAL_ADDRESS in faulty_epilogue_kernel(int*, long) at "), second
        assert d.proc.poll() is None  # the daemon is up


@pytest.mark.parametrize("key, value, expected", [
    ("symbolize_cpu_seconds", "0", "a number of seconds greater than 0"),
    ("symbolize_timeout", '"soon"', "a number of seconds greater than 0"),
    ("symbolize_memory_mb", "64", "a whole number of MB, at least 256"),
])
def test_bad_limits_in_the_config_are_one_line_and_exit_2(tmp_path: Path, key: str, value: str, expected: str) -> None:
    from ..conftest import hangwatchd

    cfg = tmp_path / "hangwatchd.toml"
    cfg.write_text(f"{key} = {value}\n")
    res = hangwatchd("daemon", "--config", str(cfg), "--state-dir", str(tmp_path / "s"),
                     "--runtime-dir", str(tmp_path / "r"), timeout=30)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert f"key '{key}'" in line and expected in line


def test_the_limits_default_as_the_example_config_says() -> None:
    import tomllib

    from hangwatchd import config

    example = tomllib.loads((Path(__file__).parents[2] / "config" / "hangwatchd.toml").read_text())
    cfg = config.load()
    assert (cfg.symbolize_cpu_seconds, cfg.symbolize_memory_mb, cfg.symbolize_timeout) == (
        example["symbolize_cpu_seconds"], example["symbolize_memory_mb"], example["symbolize_timeout"]) == (30.0, 4096, 60.0)
