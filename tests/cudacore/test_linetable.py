"""The line-table reader on hostile input: linear LEB128, bounded rows, every failure
reported (never swallowed into a silent nvdisasm answer). Fuzzed with hypothesis."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatchd.cudacore import linetable
from hangwatchd.cudacore.cubin import Cubin
from hangwatchd.cudacore.linetable import LineTable, LineTableError
from hangwatchd.cudacore.symbolize import symbolize

from ..conftest import FIXTURES
from . import hostile

CPP_IMA = FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz"


def _cubin() -> bytes:
    import lzma

    return hostile.cubin_with_lines(lzma.decompress(CPP_IMA.read_bytes()))[1]


CUBIN = _cubin()


def _encode(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@given(st.integers(0, 2**64 - 1), st.binary(max_size=4))
def test_leb128_reads_every_64_bit_number_and_where_it_ends(n: int, tail: bytes) -> None:
    data = _encode(n) + tail
    assert linetable._uleb(data, 0) == (n, len(_encode(n)))


def test_an_endless_leb128_is_refused_after_ten_bytes_in_no_time() -> None:
    # 0xff, not 0x80: each byte adds bits, which made the old decoder quadratic (320 KB: 4.4 s).
    data = b"\xff" * (1 << 20) + b"\x01"
    start = time.process_time()
    with pytest.raises(LineTableError, match="runs past 10 bytes"):
        linetable._uleb(data, 0)
    assert time.process_time() - start < 0.05


def test_a_1mb_endless_leb128_in_a_cubin_is_the_table_error() -> None:
    start = time.process_time()
    table = LineTable(hostile.with_debug_line(CUBIN, hostile.endless_leb128(1 << 20)))
    assert time.process_time() - start < 1.0
    assert table.error is not None and "LEB128" in table.error
    assert table.chain_at(0x7FB56B7A00B0) == []


def test_rows_past_the_cap_are_an_error_not_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linetable, "MAX_ROWS", 1000)
    table = LineTable(hostile.with_debug_line(CUBIN, hostile.many_rows(5000)))
    assert table.error == ".debug_line has more than 1000 rows; read no further"
    assert table.rows <= 1000


def test_the_real_table_reads_without_error() -> None:
    table = LineTable(CUBIN)
    assert table.error is None and table.rows > 0
    assert [loc.line for loc in table.chain_at(0x7FB56B7A00B0)] == [9, 13, 17]


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=400), opcode_base=st.integers(0, 20))
def test_fuzz_line_programs_never_raise(body: bytes, opcode_base: int) -> None:
    table = LineTable(hostile.with_debug_line(CUBIN, hostile.line_program(body, max(opcode_base, 1))))
    assert table.error is None or isinstance(table.error, str)
    for pc in (0, 0x7FB56B7A00B0, 2**64 - 1):
        chain = table.chain_at(pc)
        assert len(chain) <= 65 and all(isinstance(loc.line, int) for loc in chain)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, len(CUBIN) - 1), st.integers(0, 255)), min_size=1, max_size=16))
def test_fuzz_flipped_bytes_in_the_cubin_never_raise(edits: list[tuple[int, int]]) -> None:
    data = bytearray(CUBIN)
    for pos, value in edits:
        data[pos] = value
    table = LineTable(bytes(data))
    assert table.error is None or isinstance(table.error, str)
    table.chain_at(0x7FB56B7A00B0)
    cubin = Cubin(bytes(data))
    assert cubin.error is None or cubin.error.startswith("the cubin cannot be read (")
    cubin.function_at(0x7FB56B7A00B0)


@settings(max_examples=300, deadline=None)
@given(header=st.binary(min_size=64, max_size=64), tail=st.binary(max_size=512))
def test_fuzz_elf_headers_never_raise_but_say_why(header: bytes, tail: bytes) -> None:
    data = b"\x7fELF\x02\x01" + header[6:] + tail
    cubin = Cubin(data)
    assert cubin.error is None or cubin.error.startswith("the cubin cannot be read (")
    assert LineTable(data).chain_at(0) == []


def test_a_table_we_cannot_read_is_said_and_its_chains_are_marked_as_nvdisasm(
        raw_dumps: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # Our reader fails (a cap it hits), nvdisasm does not: the answer is nvdisasm's, and says so.
    monkeypatch.setattr(linetable, "MAX_ROWS", 3)
    out = symbolize(raw_dumps["cpp_ima"])
    (e,) = out.exceptions
    assert e.frames_from == "nvdisasm" and [f.line for f in e.frames] == [9, 13, 17]
    assert ("module 9 on device 0: its line table cannot be read (.debug_line has more than 3 rows; "
            "read no further); chains there come from nvdisasm") in out.notes
    alone = symbolize(raw_dumps["cpp_ima"], nvdisasm=None)
    (e,) = alone.exceptions
    assert e.frames_from is None and [f.line for f in e.frames] == [None]
