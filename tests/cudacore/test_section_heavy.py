"""A dump with 40,000 sections, shaped like a hung NCCL kernel's (issue 33): read whole,
the same answer as the dump it was made from, and a damaged header among the 40,000 is
named exactly. How fast and how small is bench/symbolize.py's to say, never a test's."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from hangwatchd.cudacore.symbolize import symbolize

from ..conftest import hangwatchd
from .section_heavy import section_heavy

SHDR = 64


@pytest.fixture(scope="module")
def heavy(raw_dumps: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    made = section_heavy(raw_dumps["cpp_hang"].read_bytes(), pad_to=0)
    path = tmp_path_factory.mktemp("heavy") / "nccl_like.nvcudmp"
    path.write_bytes(made.data)
    assert made.sections > 39_000
    return path, made.sections, made.warps


def test_every_warp_of_a_dump_with_40000_sections_is_read_and_symbolised(
        heavy: tuple[Path, int, int], raw_dumps: dict[str, Path]) -> None:
    path, _sections, warps = heavy
    base = symbolize(raw_dumps["cpp_hang"])
    got = symbolize(path)
    assert [k.name for k in got.kernels] == [k.name for k in base.kernels]
    (group,) = got.pcs
    (base_group,) = base.pcs
    assert group.warps == warps and group.lanes == warps * 32
    assert group.pc == base_group.pc and group.frames == base_group.frames
    assert len(group.sms) == 132  # every SM of device 0 holds a block now
    assert got.devices == base.devices and got.notes == ()


def _header_at(data: bytes | bytearray, i: int) -> int:
    return struct.unpack_from("<Q", data, 0x28)[0] + i * SHDR


@pytest.mark.parametrize("field, value, says", [
    (0x18, 1 << 40, "section 30000 claims bytes"),  # sh_offset past the end of the file
    (0x28, 1 << 20, "section 30000 links to section 1048576"),  # sh_link past the sections
])
def test_one_damaged_header_among_40000_is_named(heavy: tuple[Path, int, int], tmp_path: Path,
                                                 field: int, value: int, says: str) -> None:
    path, _sections, _warps = heavy
    data = bytearray(path.read_bytes())
    fmt = "<Q" if field == 0x18 else "<I"
    struct.pack_into(fmt, data, _header_at(data, 30000) + field, value)
    damaged = tmp_path / "damaged.nvcudmp"
    damaged.write_bytes(bytes(data))
    res = hangwatchd("symbolize", str(damaged), timeout=60)
    assert res.returncode == 2, (res.stdout, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert says in line and str(damaged) in line, line
