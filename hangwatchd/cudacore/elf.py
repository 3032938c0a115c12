"""The little of ELF a cubin needs: its sections by name, its symbols, its relocations.

Read with ``struct`` straight from the dump's mapping, every offset and count
checked against the cubin's bounds. pyelftools did this before; on a PyTorch
dump (hundreds of cubins, thousands of symbols) it took most of the time, and
on hostile bytes it could raise anything or build objects without end.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_RELA = struct.Struct("<QQq")

SHT_SYMTAB = 2
SHT_RELA = 4
SHT_NOBITS = 8
SHT_DYNSYM = 11
STT_FUNC = 2
SHN_LORESERVE = 0xFF00
MAX_SECTIONS = 1 << 16  # a cubin has tens; its header may claim anything
MAX_SYMBOLS = 1 << 20
MAX_NAME = 4096  # bytes of one symbol or section name: a string table with no NULs costs no more per name


class ElfError(ValueError):
    """The bytes are no ELF file we can read; the message says why."""


@dataclass(frozen=True)
class Section:
    index: int
    name: str
    type: int
    addr: int
    offset: int  # from the start of its ELF file (the cubin, or the whole dump)
    size: int
    link: int
    info: int
    entsize: int


@dataclass(frozen=True)
class Symbol:
    index: int
    name: str
    type: int
    shndx: int
    value: int
    size: int


class Elf:
    """An ELF64 little-endian file held in ``buf[base : base + size]``."""

    def __init__(self, buf: bytes | memoryview, base: int = 0, size: int | None = None) -> None:
        self.buf = buf
        self.base = base
        self.size = len(buf) - base if size is None else size
        if self.size < EHDR.size or bytes(buf[base : base + 4]) != b"\x7fELF":
            raise ElfError("not an ELF file")
        ident, *_r, shoff, _flags, _ehsize, _phentsize, _phnum, shentsize, shnum, shstrndx = EHDR.unpack_from(buf, base)
        if ident[4] != 2 or ident[5] != 1:
            raise ElfError("not a 64-bit little-endian ELF file")
        if shnum > MAX_SECTIONS or shentsize < SHDR.size:
            raise ElfError(f"claims {shnum} sections of {shentsize} bytes")
        self._check(shoff, shnum * shentsize, "the section header table")
        raw = [SHDR.unpack_from(buf, base + shoff + i * shentsize) for i in range(shnum)]
        names = raw[shstrndx] if shstrndx < shnum else None
        if names is not None:
            self._check(names[4], names[5], "the section name table")
        self.sections: list[Section] = []
        for i, (nm, typ, _flg, addr, off, size, link, info, _align, entsize) in enumerate(raw):
            if typ != SHT_NOBITS:
                self._check(off, size, f"section {i}")
            name = self._cstr(names[4], names[5], nm) if names is not None else ""
            self.sections.append(Section(i, name, typ, addr, off, size, link, info, entsize))

    def _check(self, off: int, size: int, what: str) -> None:
        if off + size > self.size:
            raise ElfError(f"{what} claims bytes {off}..{off + size} of a {self.size}-byte file")

    def _cstr(self, table: int, limit: int, at: int) -> str:
        if at >= limit:
            return ""
        start = self.base + table + at
        stop = min(self.base + table + limit, start + MAX_NAME)
        end = self.buf.find(b"\0", start, stop) if hasattr(self.buf, "find") else -1
        if end < 0:
            end = stop
        return bytes(self.buf[start:end]).decode("utf-8", "replace")

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def data(self, s: Section) -> bytes:
        if s.type == SHT_NOBITS:
            return b""
        return bytes(self.buf[self.base + s.offset : self.base + s.offset + s.size])

    def symbols(self, s: Section, deadline: float | None = None) -> list[Symbol]:
        """Every symbol of a symbol table section, named through its linked string table
        (ElfError past ``deadline``, a monotonic time, where one is given)."""
        if s.type == SHT_NOBITS:
            return []
        if s.entsize < _SYM.size:
            raise ElfError(f"symbol table {s.name} has entries of {s.entsize} bytes")
        count = s.size // s.entsize
        if count > MAX_SYMBOLS:
            raise ElfError(f"symbol table {s.name} claims {count} symbols")
        strtab = self.sections[s.link] if s.link < len(self.sections) else None
        out = []
        for i in range(count):
            if deadline is not None and not i & 0xFFFF and time.monotonic() > deadline:
                raise ElfError(f"symbol table {s.name}: not read by the deadline ({i} of {count} symbols)")
            nm, info, _other, shndx, value, size = _SYM.unpack_from(self.buf, self.base + s.offset + i * s.entsize)
            name = self._cstr(strtab.offset, strtab.size, nm) if strtab is not None else ""
            out.append(Symbol(i, name, info & 0xF, shndx, value, size))
        return out

    def symbol_tables(self) -> list[Section]:
        return [s for s in self.sections if s.type in (SHT_SYMTAB, SHT_DYNSYM)]

    def relocations(self, s: Section) -> list[tuple[int, int, int]]:
        """(offset, symbol index, addend) of each entry of a SHT_RELA section."""
        if s.type == SHT_NOBITS:
            return []
        entsize = s.entsize or _RELA.size
        if entsize < _RELA.size:
            raise ElfError(f"relocation section {s.name} has entries of {entsize} bytes")
        count = s.size // entsize
        if count > MAX_SYMBOLS:
            raise ElfError(f"relocation section {s.name} claims {count} entries")
        out = []
        for i in range(count):
            offset, info, addend = _RELA.unpack_from(self.buf, self.base + s.offset + i * entsize)
            out.append((offset, info >> 32, addend))
        return out
