"""A module's relocated cubin: which function holds a PC, and its name."""

from __future__ import annotations

import bisect
import functools
import io
from dataclasses import dataclass



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
    import cxxfilt  # imported here: a dump of only C names never needs it

    try:
        return cxxfilt.demangle(mangled)
    except (cxxfilt.InvalidName, cxxfilt.LibraryNotFound, UnicodeDecodeError):
        return mangled


class Cubin:
    """The loaded functions of one cubin, by address (relocated: addresses are the GPU's)."""

    def __init__(self, image: bytes) -> None:
        self.image = image
        self.functions: list[Function] = []
        self.error: str | None = None
        self._starts: list[int] | None = None
        try:
            self._load()
        except Exception as exc:  # noqa: BLE001 - pyelftools on hostile bytes can raise anything
            self.error = f"the cubin cannot be read ({type(exc).__name__}: {exc})"

    def _load(self) -> None:
        from elftools.elf.elffile import ELFFile
        from elftools.elf.sections import SymbolTableSection

        elf = ELFFile(io.BytesIO(self.image))
        has_lines = elf.get_section_by_name(".debug_line") is not None
        for sec in elf.iter_sections():
            if not isinstance(sec, SymbolTableSection):
                continue
            for index, sym in enumerate(sec.iter_symbols()):
                if sym["st_info"]["type"] != "STT_FUNC" or not sym.name:
                    continue
                shndx = sym["st_shndx"]
                if not isinstance(shndx, int):
                    continue
                text = elf.get_section(shndx)
                # Relocation made st_value the function's GPU address; zero means not loaded.
                start = sym["st_value"] or text["sh_addr"]
                if start == 0:
                    continue
                size = sym["st_size"] or text["sh_size"]
                self.functions.append(Function(sym.name, start, size, index, has_lines))

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
