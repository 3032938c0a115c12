"""Bad dumps: one line on stderr naming the file and what is wrong, exit status 2,
never a traceback, never a hang. The reader is fuzzed with hypothesis."""

from __future__ import annotations

import gzip
import lzma
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatchd.cudacore.errors import CoreDumpError
from hangwatchd.cudacore.reader import open_dump
from hangwatchd.cudacore.symbolize import symbolize

from ..conftest import FIXTURES, hangwatchd

CPP_IMA = lzma.decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes())
SHOFF = struct.unpack_from("<Q", CPP_IMA, 0x28)[0]
SHNUM = struct.unpack_from("<H", CPP_IMA, 0x3C)[0]


def section_header(data: bytes | bytearray, i: int) -> int:
    return SHOFF + i * 64


def find_section(data: bytes | bytearray, type_: int) -> int:
    for i in range(SHNUM):
        if struct.unpack_from("<I", data, section_header(data, i) + 4)[0] == type_:
            return i
    raise AssertionError(type_)


def refused(path: Path, *needles: str, extra: tuple[str, ...] = ()) -> str:
    res = hangwatchd("symbolize", *extra, str(path), timeout=60)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert str(path) in lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_a_text_file(tmp_path: Path) -> None:
    refused(write(tmp_path, "notes.txt", b"hello, this is not a dump\n" * 10), "not an ELF file")


def test_an_empty_file(tmp_path: Path) -> None:
    refused(write(tmp_path, "empty.nvcudmp", b""), "too short")


def test_a_host_elf_binary(tmp_path: Path) -> None:
    refused(write(tmp_path, "python", Path("/bin/true").read_bytes()), "not EM_CUDA")


def test_a_cubin_is_not_a_coredump(tmp_path: Path) -> None:
    with open_dump(write(tmp_path, "d", CPP_IMA)) as dump:
        cubin = dump.image(dump.modules[-1])
    refused(write(tmp_path, "kernel.cubin", cubin), "cubin", "not a CUDA coredump")


@pytest.mark.parametrize("keep", [100, 4096, len(CPP_IMA) // 2, len(CPP_IMA) - 1])
def test_a_truncated_dump(tmp_path: Path, keep: int) -> None:
    refused(write(tmp_path, f"cut{keep}.nvcudmp", CPP_IMA[:keep]), "truncated")


def test_a_truncated_compressed_dump(tmp_path: Path) -> None:
    xz = (FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes()
    refused(write(tmp_path, "cut.nvcudmp.xz", xz[: len(xz) // 2]), "compressed file is damaged")


def test_a_table_that_lies_about_its_size(tmp_path: Path) -> None:
    data = bytearray(CPP_IMA)
    i = find_section(data, 0x80000000 + 12)  # the grid table
    struct.pack_into("<Q", data, section_header(data, i) + 0x20, 10**12)
    refused(write(tmp_path, "lying-size.nvcudmp", bytes(data)), "lies about its sizes")


def test_a_table_whose_rows_are_too_small(tmp_path: Path) -> None:
    data = bytearray(CPP_IMA)
    i = find_section(data, 0x80000000 + 12)
    struct.pack_into("<Q", data, section_header(data, i) + 0x38, 16)
    refused(write(tmp_path, "small-rows.nvcudmp", bytes(data)), "smaller than")


def test_a_table_whose_size_is_not_whole_rows(tmp_path: Path) -> None:
    data = bytearray(CPP_IMA)
    i = find_section(data, 0x80000000 + 14)  # a warp table
    struct.pack_into("<Q", data, section_header(data, i) + 0x20, 63)
    refused(write(tmp_path, "odd-size.nvcudmp", bytes(data)), "whole number")


def test_a_cubin_nvdisasm_rejects(tmp_path: Path) -> None:
    data = bytearray(CPP_IMA)
    with open_dump(write(tmp_path, "d", CPP_IMA)) as dump:
        img = dump.modules[-1].image
    assert img is not None
    # Scramble the kernel's instructions region header: the cubin's ELF flags name no GPU.
    struct.pack_into("<I", data, img.offset + 0x30, 0xFFFFFFFF)
    line = refused(write(tmp_path, "bad-cubin.nvcudmp", bytes(data)), "nvdisasm", extra=("--chains", "nvdisasm"))
    assert "module 9" in line


def test_a_directory_and_a_missing_file(tmp_path: Path) -> None:
    refused(tmp_path, "directory")
    refused(tmp_path / "nope.nvcudmp", "no such file")


def test_a_fifo_named_like_a_dump_is_refused_without_waiting(tmp_path: Path) -> None:
    import os
    import time

    fifo = tmp_path / "core_host.1.2.nvcudmp"
    os.mkfifo(fifo)
    start = time.monotonic()
    refused(fifo, "not a regular file")
    assert time.monotonic() - start < 30  # a blocking open would wait for a writer for ever


def test_gzip_of_garbage(tmp_path: Path) -> None:
    refused(write(tmp_path, "g.gz", gzip.compress(b"\0" * 1000)), "not an ELF file")


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    buf = bytearray(data)
    for pos, value in edits:
        buf[pos % len(buf)] = value
    return bytes(buf)


def _check(path: Path) -> None:
    try:
        symbolize(path, nvdisasm=None)
    except CoreDumpError as exc:
        assert str(path) in str(exc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(CPP_IMA)))
def test_fuzz_truncation(tmp_path: Path, cut: int) -> None:
    _check(write(tmp_path, "t.nvcudmp", CPP_IMA[:cut]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=32))
def test_fuzz_flipped_bytes(tmp_path: Path, edits: list[tuple[int, int]]) -> None:
    _check(write(tmp_path, "f.nvcudmp", _mutate(CPP_IMA, edits)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    section=st.integers(0, SHNUM - 1),
    field=st.sampled_from([0x18, 0x20, 0x38, 0x28, 0x2C]),  # offset, size, entsize, link, info
    value=st.one_of(st.integers(0, 2**16), st.integers(0, 2**64 - 1)),
)
def test_fuzz_section_headers(tmp_path: Path, section: int, field: int, value: int) -> None:
    data = bytearray(CPP_IMA)
    at = section_header(data, section) + field
    if field in (0x28, 0x2C):
        struct.pack_into("<I", data, at, value & 0xFFFFFFFF)
    else:
        struct.pack_into("<Q", data, at, value)
    _check(write(tmp_path, "h.nvcudmp", bytes(data)))
