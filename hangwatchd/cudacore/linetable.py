"""The whole inline chain at a PC, from the cubin's ``.debug_line``.

This is the table ``nvdisasm -gi`` prints from, read directly: for each
instruction its file and line, and through NVIDIA's two line-program
extensions (the same ones elfutils reads), ``DW_LNE_NVIDIA_inlined_call``
(context row, function name) and ``DW_LNE_NVIDIA_set_function_name``, the
chain of inlined calls. A row's context is the 1-based index, within its
sequence, of the row that called it, so following contexts walks the chain
outwards. nvdisasm also prints files and lines but not the inlined functions'
names; and it takes 0.3 s or more per cubin, more than cuda-gdb takes for a
whole dump. pyelftools skips unknown extended opcodes, hence this small
interpreter of DWARF 2-4 line programs (and ``elf.py`` for the sections).
"""

from __future__ import annotations

import bisect
import struct
from array import array
from dataclasses import dataclass

from .elf import SHT_RELA, Elf, ElfError

DW_LNE_end_sequence = 1
DW_LNE_set_address = 2
DW_LNE_NVIDIA_inlined_call = 0x90
DW_LNE_NVIDIA_set_function_name = 0x91

# A hostile cubin's line program must cost bounded time and memory: ptxas writes
# a few MB at most for the biggest kernels we have seen.
MAX_SECTION_BYTES = 64 << 20
MAX_ROWS = 4 << 20  # 40 bytes a row in the arrays below
MAX_LEB_BYTES = 10  # 64 bits; a longer number is no address, line or index


class LineTableError(Exception):
    """The line program cannot be read; the message says what and where."""


@dataclass(frozen=True)
class Location:
    function: str | None  # the inlined function's mangled name; None for the function itself
    file: str
    line: int


_M64 = (1 << 64) - 1
_BIG = (1 << 62) - 1


def _clamp(v: int) -> int:
    """Fit a hostile value into a signed 64-bit array slot (real ones always fit)."""
    return v if -_BIG <= v <= _BIG else _BIG


class LineTable:
    """Answers: at this PC, which source lines of which functions, innermost first.

    ``error`` says why the table could not be read (then ``chain_at`` knows
    nothing, and the caller says so and asks nvdisasm instead).
    """

    def __init__(self, image: bytes | memoryview, base: int = 0, size: int | None = None) -> None:
        """The line table of the cubin at ``image[base : base + size]``."""
        # One row a program row, in parallel arrays: 40 bytes a row, not a Python object.
        self._addr = array("Q")
        self._file = array("q")
        self._line = array("q")
        self._context = array("q")
        self._fname = array("q")
        self.files: list[str] = []
        self.strings = b""
        self.error: str | None = None
        self._sequences: list[tuple[int, int, int]] = []  # (start address, first row, end row)
        self._unit_files = 0
        try:
            self._load(Elf(image, base, size))
        except LineTableError as exc:
            self.error = str(exc)
        except ElfError as exc:
            self.error = f"its ELF cannot be read ({exc})"
        if self.error:
            self._sequences = []
        self._sequences.sort()
        self._starts = [s[0] for s in self._sequences]

    @property
    def rows(self) -> int:
        return len(self._addr)

    def _load(self, elf: Elf) -> None:
        line = elf.section(".debug_line")
        strs = elf.section(".debug_str")
        if line is None:
            return
        for sec in (line, strs):
            if sec is not None and sec.size > MAX_SECTION_BYTES:
                raise LineTableError(f"{sec.name} claims {sec.size} bytes, more than the "
                                     f"{MAX_SECTION_BYTES >> 20} MB we read")
        self.strings = elf.data(strs) if strs is not None else b""
        data = bytearray(elf.data(line))
        rela = elf.section(".rela.debug_line")
        if rela is not None and rela.type == SHT_RELA and rela.link < len(elf.sections):
            symbols = elf.symbols(elf.sections[rela.link])
            for offset, sym, addend in elf.relocations(rela):
                if sym < len(symbols) and offset + 8 <= len(data):
                    struct.pack_into("<Q", data, offset, (symbols[sym].value + addend) & _M64)
        self._run_units(bytes(data))

    def _run_units(self, data: bytes) -> None:
        pos = 0
        while pos + 4 <= len(data):
            (length,) = struct.unpack_from("<I", data, pos)
            if length == 0 or length >= 0xFFFFFFF0:
                return  # empty or 64-bit DWARF: not what ptxas writes
            end = min(pos + 4 + length, len(data))
            try:
                self._run_unit(data, pos + 4, end)
            except (IndexError, struct.error, ValueError) as exc:
                raise LineTableError(f".debug_line unit at offset {pos} is damaged ({exc or type(exc).__name__})") from None
            pos = end

    def _run_unit(self, data: bytes, pos: int, end: int) -> None:
        version, header_length = struct.unpack_from("<HI", data, pos)
        if version > 4:
            return
        p = pos + 6
        min_inst = data[p]
        if version >= 4:
            p += 1  # maximum_operations_per_instruction
        line_base = struct.unpack_from("<b", data, p + 2)[0]
        line_range = data[p + 3]
        opcode_base = data[p + 4]
        std_lengths = data[p + 5 : p + 5 + opcode_base - 1]
        self._read_files(data, p + 5 + opcode_base - 1, end)
        file_base = len(self.files) - self._unit_files
        p = pos + 6 + header_length
        if line_range == 0:
            return
        address, file, line, context, fname = 0, 1, 1, 0, 0
        addrs, files, lines, contexts, fnames = self._addr, self._file, self._line, self._context, self._fname
        seq_start_row = len(addrs)
        room = MAX_ROWS - len(addrs)

        def emit() -> None:
            nonlocal room
            if room <= 0:
                raise LineTableError(f".debug_line has more than {MAX_ROWS} rows; read no further")
            room -= 1
            addrs.append(address & _M64)
            files.append(_clamp(file_base + file - 1))
            lines.append(_clamp(line))
            contexts.append(_clamp(context))
            fnames.append(_clamp(fname))

        while p < end:
            op = data[p]
            p += 1
            if op >= opcode_base:
                adj = op - opcode_base
                address += (adj // line_range) * min_inst
                line += line_base + adj % line_range
                emit()
            elif op == 0:
                n, p = _uleb(data, p)
                sub, body = data[p], p + 1
                p += n
                if sub == DW_LNE_end_sequence:
                    emit()
                    first = addrs[seq_start_row] if seq_start_row < len(addrs) else address & _M64
                    self._sequences.append((first, seq_start_row, len(addrs)))
                    address, file, line, context, fname = 0, 1, 1, 0, 0
                    seq_start_row = len(addrs)
                elif sub == DW_LNE_set_address:
                    (address,) = struct.unpack_from("<Q", data, body)
                elif sub == DW_LNE_NVIDIA_inlined_call:
                    context, body = _uleb(data, body)
                    fname, _ = _uleb(data, body)
                elif sub == DW_LNE_NVIDIA_set_function_name:
                    fname, _ = _uleb(data, body)
            elif op == 1:  # copy
                emit()
            elif op == 2:  # advance_pc
                n, p = _uleb(data, p)
                address += n * min_inst
            elif op == 3:  # advance_line
                n, p = _sleb(data, p)
                line += n
            elif op == 4:  # set_file
                file, p = _uleb(data, p)
            elif op == 8:  # const_add_pc
                address += ((255 - opcode_base) // line_range) * min_inst
            elif op == 9:  # fixed_advance_pc
                (n,) = struct.unpack_from("<H", data, p)
                p += 2
                address += n
            else:  # operands we do not need: skip them by the header's counts
                for _ in range(std_lengths[op - 1] if op - 1 < len(std_lengths) else 0):
                    _, p = _uleb(data, p)
            # Keep Python's integers small: a hostile program could grow them without end.
            address &= _M64
            line = _clamp(line)

    def _read_files(self, data: bytes, p: int, end: int) -> None:
        """DWARF 2-4 header: include directories, then file entries (name, dir, mtime, length)."""
        dirs = [""]
        while data[p]:
            stop = data.index(b"\0", p, end)
            dirs.append(data[p:stop].decode("utf-8", "replace"))
            p = stop + 1
        p += 1
        count = 0
        while data[p]:
            stop = data.index(b"\0", p, end)
            name = data[p:stop].decode("utf-8", "replace")
            d, p = _uleb(data, stop + 1)
            _, p = _uleb(data, p)
            _, p = _uleb(data, p)
            directory = dirs[d] if d < len(dirs) else ""
            self.files.append(name if name.startswith("/") or not directory else f"{directory}/{name}")
            count += 1
        self._unit_files = count

    def _name(self, offset: int) -> str | None:
        if not 0 <= offset < len(self.strings):
            return None
        end = self.strings.find(b"\0", offset)
        return self.strings[offset : end if end >= 0 else None].decode("utf-8", "replace")

    def chain_at(self, pc: int) -> list[Location]:
        """The source locations at ``pc``, innermost first; the last is in the function itself."""
        i = bisect.bisect_right(self._starts, pc) - 1
        if i < 0:
            return []
        _, first, last = self._sequences[i]
        j = bisect.bisect_right(self._addr, pc, first, last) - 1
        if j < first or j == last - 1:
            return []  # before the first row, or at/after the end of the sequence
        row = j
        chain: list[Location] = []
        # A context is the 1-based index of the calling row within the same sequence.
        while self._context[row] and len(chain) < 64:
            chain.append(Location(self._name(self._fname[row]), self._path(self._file[row]), self._line[row]))
            context = self._context[row]
            if not 0 < context <= last - first:
                return chain
            row = first + context - 1
        chain.append(Location(None, self._path(self._file[row]), self._line[row]))
        return chain

    def _path(self, index: int) -> str:
        return self.files[index] if 0 <= index < len(self.files) else "?"


def _leb(data: bytes, p: int, signed: bool = False) -> tuple[int, int]:
    """A LEB128 number at ``p``: (value, position after it).

    At most MAX_LEB_BYTES bytes: a longer run of continuation bytes is an error,
    not a number to build (shifting a growing integer made this quadratic).
    """
    value = shift = 0
    for i in range(MAX_LEB_BYTES):
        b = data[p + i]
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if signed and b & 0x40:
                value -= 1 << shift
            return value, p + i + 1
    raise LineTableError(f"a LEB128 number at offset {p} runs past {MAX_LEB_BYTES} bytes")


def _uleb(data: bytes, p: int) -> tuple[int, int]:
    return _leb(data, p)


def _sleb(data: bytes, p: int) -> tuple[int, int]:
    return _leb(data, p, signed=True)
