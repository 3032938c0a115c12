"""Hostile dumps made from a real one: the cubin of one module gets a ``.debug_line``
of our choosing, appended to the file, with the section headers pointed at it."""

from __future__ import annotations

import struct

RELF_IMG = 0x80000000 + 7
_SH = struct.Struct("<IIQQQQIIQQ")


def _sections(elf: bytes) -> list[tuple[int, tuple[int, ...]]]:
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    return [(shoff + i * shentsize, _SH.unpack_from(elf, shoff + i * shentsize)) for i in range(shnum)]


def _name_of(elf: bytes, name_offset: int) -> bytes:
    shstrndx = struct.unpack_from("<H", elf, 0x3E)[0]
    _, strtab = _sections(elf)[shstrndx]
    start = strtab[4] + name_offset
    return elf[start : elf.index(b"\0", start)]


def with_debug_line(cubin: bytes, debug_line: bytes) -> bytes:
    """The cubin with its .debug_line replaced (and its relocations dropped)."""
    out = bytearray(cubin)
    at = len(out)
    out += debug_line
    found = False
    for header, sh in _sections(cubin):
        name = _name_of(cubin, sh[0])
        if name == b".debug_line":
            struct.pack_into("<QQ", out, header + 0x18, at, len(debug_line))
            found = True
        elif name == b".rela.debug_line":
            struct.pack_into("<Q", out, header + 0x20, 0)
    assert found, "the cubin has no .debug_line"
    return bytes(out)


def with_cubin(dump: bytes, module_image: int, cubin: bytes) -> bytes:
    """The dump with the relocated cubin ``module_image`` (n-th RELF image) replaced."""
    out = bytearray(dump)
    images = [header for header, sh in _sections(dump) if sh[1] == RELF_IMG]
    header = images[module_image]
    at = len(out)
    out += cubin
    struct.pack_into("<QQ", out, header + 0x18, at, len(cubin))
    return bytes(out)


def cubin_with_lines(dump: bytes) -> tuple[int, bytes]:
    """The first relocated cubin of the dump that has a .debug_line: (its index, its bytes)."""
    images = [sh for _, sh in _sections(dump) if sh[1] == RELF_IMG]
    for i, sh in enumerate(images):
        cubin = dump[sh[4] : sh[4] + sh[5]]
        if any(_name_of(cubin, s[0]) == b".debug_line" for _, s in _sections(cubin)):
            return i, cubin
    raise AssertionError("no cubin with line information")


def line_program(body: bytes, opcode_base: int = 13) -> bytes:
    """One DWARF 2 line-program unit: a header with no files, then ``body``."""
    header = bytes([1, 1, 0xFB & 0xFF, 14, opcode_base]) + bytes([0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1])[: opcode_base - 1]
    header += b"\0" + b"\0"  # no include directories, no files
    unit = struct.pack("<HI", 2, len(header)) + header + body
    return struct.pack("<I", len(unit)) + unit


def endless_leb128(size: int = 1 << 20) -> bytes:
    """DW_LNS_advance_pc whose operand is ``size`` bytes of continuation: the quadratic case."""
    return line_program(b"\x02" + b"\xff" * size + b"\x01")


def many_rows(size: int = 1 << 20) -> bytes:
    """``size`` special opcodes: one row each, the most rows a table of that size can hold."""
    return line_program(b"\x20" * size)


def hostile_dump(dump: bytes, debug_line: bytes) -> bytes:
    index, cubin = cubin_with_lines(dump)
    return with_cubin(dump, index, with_debug_line(cubin, debug_line))
