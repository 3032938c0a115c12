"""What a dump's headers can inflate is capped, and each cap hit is a note in the
output, never an exception: lanes for one warp, lanes and rows in all."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from hangwatchd.cudacore import reader
from hangwatchd.cudacore.symbolize import symbolize

from ..conftest import hangwatchd
from .test_bad_input import CPP_IMA, find_section, section_header

LN_TABLE = 0x80000000 + 15


def test_a_lane_table_claiming_thousands_of_lanes_for_one_warp_is_read_up_to_the_cap(tmp_path: Path) -> None:
    data = bytearray(CPP_IMA)
    at = section_header(data, find_section(data, LN_TABLE))
    entsize = struct.unpack_from("<Q", data, at + 0x38)[0]
    rows = len(CPP_IMA) // entsize - 1
    struct.pack_into("<QQ", data, at + 0x18, 0, rows * entsize)  # every byte of the file, read as lanes
    dump = tmp_path / "lanes.nvcudmp"
    dump.write_bytes(bytes(data))
    res = hangwatchd("symbolize", "--json", str(dump))
    assert res.returncode == 0, res.stderr
    assert f"claims {rows} lanes for one warp; only the first 64 were read" in res.stdout


def test_rows_and_lanes_past_the_caps_are_notes(raw_dumps: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "MAX_LANES", 16)
    out = symbolize(raw_dumps["cpp_ima"])
    assert "the dump's lane tables claim more than 16 lanes; the rest were not read" in out.notes
    assert sum(p.lanes for p in out.pcs) == 16
    monkeypatch.setattr(reader, "MAX_ROWS", 8)
    out = symbolize(raw_dumps["cpp_ima"])
    assert any(n.startswith("the dump's tables claim more than 8 rows;") for n in out.notes), out.notes
