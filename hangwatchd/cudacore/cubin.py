"""A module's relocated cubin: which function holds a PC, and its name."""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from .elf import SHN_LORESERVE, STT_FUNC, Elf, ElfError


@dataclass(frozen=True)
class Function:
    mangled: str
    start: int
    size: int
    symbol_index: int
    has_line_info: bool

    @property
    def name(self) -> str:
        return demangle(self.mangled)


@functools.lru_cache(maxsize=4096)
def demangle(mangled: str) -> str:
    if not mangled.startswith("_Z"):
        return mangled
    from .demangle import (
        demangle_symbol,  # imported here: a dump of only C names never needs it
    )

    return demangle_symbol(mangled)


class Cubin:
    """The loaded functions of one cubin, by address (relocated: addresses are the GPU's)."""

    def __init__(self, image: bytes | memoryview, base: int = 0, size: int | None = None) -> None:
        """The cubin at ``image[base : base + size]`` (a dump's mapping: nothing is copied)."""
        self.functions: list[Function] = []
        self.error: str | None = None
        self._starts: list[int] | None = None
        try:
            self._load(Elf(image, base, size))
        except ElfError as exc:
            self.error = f"the cubin cannot be read ({exc})"

    def _load(self, elf: Elf) -> None:
        has_lines = elf.section(".debug_line") is not None
        for table in elf.symbol_tables():
            for sym in elf.symbols(table):
                if sym.type != STT_FUNC or not sym.name:
                    continue
                if sym.shndx == 0 or sym.shndx >= SHN_LORESERVE or sym.shndx >= len(elf.sections):
                    continue  # undefined, absolute or common: no code of this cubin
                text = elf.sections[sym.shndx]
                # Relocation made st_value the function's GPU address; zero means not loaded.
                start = sym.value or text.addr
                if start == 0:
                    continue
                self.functions.append(Function(sym.name, start, sym.size or text.size, sym.index, has_lines))

    def function_at(self, pc: int) -> Function | None:
        if self._starts is None:
            self.functions.sort(key=lambda f: f.start)
            self._starts = [f.start for f in self.functions]
        # Functions do not overlap in a real cubin; a few steps back covers a damaged one.
        i = bisect.bisect_right(self._starts, pc) - 1
        for f in self.functions[max(i - 7, 0) : i + 1][::-1]:
            if f.start <= pc < f.start + f.size:
                return f
        return None
