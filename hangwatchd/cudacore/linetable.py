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
interpreter of DWARF 2-4 line programs.
"""

from __future__ import annotations

import bisect
import io
import struct
from dataclasses import dataclass

from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection

DW_LNE_end_sequence = 1
DW_LNE_set_address = 2
DW_LNE_NVIDIA_inlined_call = 0x90
DW_LNE_NVIDIA_set_function_name = 0x91


@dataclass(frozen=True)
class Row:
    address: int
    file: int
    line: int
    context: int
    function_name: int


@dataclass(frozen=True)
class Location:
    function: str | None  # the inlined function's mangled name; None for the function itself
    file: str
    line: int


class LineTable:
    """Answers: at this PC, which source lines of which functions, innermost first."""

    def __init__(self, image: bytes) -> None:
        self.rows: list[Row] = []
        self.files: list[str] = []
        self.strings = b""
        self._sequences: list[tuple[int, int, int]] = []  # (start address, first row, end row)
        try:
            self._load(image)
        except Exception:  # noqa: BLE001 - names are a nicety; damaged debug info just loses them
            self.rows, self._sequences = [], []
        self._starts = [s[0] for s in self._sequences]

    def _load(self, image: bytes) -> None:
        elf = ELFFile(io.BytesIO(image))
        line = elf.get_section_by_name(".debug_line")
        strs = elf.get_section_by_name(".debug_str")
        if line is None:
            return
        self.strings = strs.data() if strs is not None else b""
        data = bytearray(line.data())
        rela = elf.get_section_by_name(".rela.debug_line")
        if isinstance(rela, RelocationSection):
            symtab = elf.get_section(rela["sh_link"])
            for r in rela.iter_relocations():
                value = symtab.get_symbol(r["r_info_sym"])["st_value"] + r["r_addend"]
                if r["r_offset"] + 8 <= len(data):
                    struct.pack_into("<Q", data, r["r_offset"], value & 0xFFFFFFFFFFFFFFFF)
        self._run_units(bytes(data))

    def _run_units(self, data: bytes) -> None:
        pos = 0
        while pos + 4 <= len(data):
            (length,) = struct.unpack_from("<I", data, pos)
            if length == 0 or length >= 0xFFFFFFF0:
                return  # empty or 64-bit DWARF: not what ptxas writes
            end = min(pos + 4 + length, len(data))
            self._run_unit(data, pos + 4, end)
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
        self._read_files(data, p + 5 + opcode_base - 1)
        file_base = len(self.files) - self._unit_files
        p = pos + 6 + header_length
        if line_range == 0:
            return
        address, file, line, context, fname = 0, 1, 1, 0, 0
        seq_start_row = len(self.rows)

        def emit() -> None:
            self.rows.append(Row(address, file_base + file - 1, line, context, fname))

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
                    self._sequences.append((self.rows[seq_start_row].address if seq_start_row < len(self.rows) else address, seq_start_row, len(self.rows)))
                    address, file, line, context, fname = 0, 1, 1, 0, 0
                    seq_start_row = len(self.rows)
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
        self._sequences.sort()

    _unit_files = 0

    def _read_files(self, data: bytes, p: int) -> None:
        """DWARF 2-4 header: include directories, then file entries (name, dir, mtime, length)."""
        dirs = [""]
        while data[p]:
            end = data.index(b"\0", p)
            dirs.append(data[p:end].decode("utf-8", "replace"))
            p = end + 1
        p += 1
        count = 0
        while data[p]:
            end = data.index(b"\0", p)
            name = data[p:end].decode("utf-8", "replace")
            d, p = _uleb(data, end + 1)
            _, p = _uleb(data, p)
            _, p = _uleb(data, p)
            directory = dirs[d] if d < len(dirs) else ""
            self.files.append(name if name.startswith("/") or not directory else f"{directory}/{name}")
            count += 1
        self._unit_files = count

    def _name(self, offset: int) -> str | None:
        if offset >= len(self.strings):
            return None
        end = self.strings.find(b"\0", offset)
        return self.strings[offset : end if end >= 0 else None].decode("utf-8", "replace")

    def chain_at(self, pc: int) -> list[Location]:
        """The source locations at ``pc``, innermost first; the last is in the function itself."""
        i = bisect.bisect_right(self._starts, pc) - 1
        if i < 0:
            return []
        _, first, last = self._sequences[i]
        addrs = [r.address for r in self.rows[first:last]]
        j = bisect.bisect_right(addrs, pc) - 1
        if j < 0 or j == last - first - 1:
            return []  # before the first row, or at/after the end of the sequence
        row = self.rows[first + j]
        chain: list[Location] = []
        # A context is the 1-based index of the calling row within the same sequence.
        while row.context and len(chain) < 64:
            chain.append(Location(self._name(row.function_name), self._file(row.file), row.line))
            if not 0 < row.context <= last - first:
                return chain
            row = self.rows[first + row.context - 1]
        chain.append(Location(None, self._file(row.file), row.line))
        return chain

    def _file(self, index: int) -> str:
        return self.files[index] if 0 <= index < len(self.files) else "?"


def _leb(data: bytes, p: int, signed: bool = False) -> tuple[int, int]:
    """A LEB128 number at ``p``: (value, position after it)."""
    value = shift = 0
    while True:
        b = data[p]
        p += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if signed and b & 0x40:
                value -= 1 << shift
            return value, p


def _uleb(data: bytes, p: int) -> tuple[int, int]:
    return _leb(data, p)


def _sleb(data: bytes, p: int) -> tuple[int, int]:
    return _leb(data, p, signed=True)
