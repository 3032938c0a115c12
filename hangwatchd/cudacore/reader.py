"""Reading a CUDA coredump: the ELF frame, then the driver's tables.

The outer ELF is walked by hand with ``struct`` over a read-only mapping:
a dump holds tens of thousands of sections, every offset and size is
checked against the file before it is used, and nothing is copied but the
rows we decode and the cubins we are asked for.
"""

from __future__ import annotations

import contextlib
import operator
import os
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from . import layout as L
from .elf import EHDR, SHDR, SHT_NOBITS, Section
from .errors import CoreDumpError
from .source import mapped

# What a dump's headers can inflate, capped: sections may overlap, so a small
# hostile file can claim any number of rows. The biggest real dumps (8 GPUs of
# 132 SMs x 64 warps x 32 lanes) stay well inside. Past a cap we read no further
# and say so in the result's notes.
MAX_SECTIONS = 1 << 20
MAX_ROWS = 1 << 20  # all driver tables together
MAX_LANES = 4 << 20
MAX_LANES_PER_WARP = 64

SHT_STRTAB = 3
NAME_MAX = 4096  # bytes of a string read from a string table (names of sections and devices: the driver's are short)
SMALL = 16 << 20  # bytes of a table read whole (copied); bigger ones are read row by row in the mapping

# The sections whose contents we decode; a dump's other sections (registers, predicates,
# backtraces, parameters, constant banks of every lane and warp) are checked, never read.
_READ = frozenset((L.SHT_DEV_TABLE, L.SHT_CTX_TABLE, L.SHT_MOD_TABLE, L.SHT_RELF_IMG, L.SHT_GRID_TABLE,
                   L.SHT_SM_TABLE, L.SHT_CTA_TABLE, L.SHT_WP_TABLE, L.SHT_LN_TABLE, L.SHT_META_DATA, SHT_STRTAB))
HEADERS_AT_ONCE = 4096  # section headers read (256 KiB) and checked together


def _columns(table: bytes) -> tuple[Sequence[int], Sequence[int], Sequence[int], Sequence[int]]:
    """Type, offset, size and link of each of a run of ELF's 64-byte section headers, as
    strided views over their bytes: no object per header (a dump may have a million)."""
    if sys.byteorder == "little":
        words, quads = memoryview(table).cast("I"), memoryview(table).cast("Q")
        return words[1::16], quads[3::8], quads[4::8], words[10::16]
    rows = list(SHDR.iter_unpack(table))
    return [r[1] for r in rows], [r[4] for r in rows], [r[5] for r in rows], [r[6] for r in rows]


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    type: str
    sm_type: str
    num_sms: int
    warps_per_sm: int
    lanes_per_warp: int
    sm_version: str


@dataclass(frozen=True)
class Module:
    device: int
    context: int
    index: int
    handle: int
    image: Section | None


@dataclass(frozen=True)
class Grid:
    device: int
    index: int
    grid_id: int
    context_id: int
    function_entry: int
    module_handle: int
    status: str
    grid_dim: tuple[int, int, int]
    block_dim: tuple[int, int, int]
    host_tid: int


@dataclass(frozen=True, slots=True)  # a dump holds tens of thousands
class Lane:
    lane: int
    pc: int
    thread_idx: tuple[int, int, int]
    exception: int


@dataclass(frozen=True)
class Warp:
    device: int
    sm: int
    grid_id: int
    block_idx: tuple[int, int, int]
    warp_id: int
    valid_mask: int
    active_mask: int
    error_pc: int | None
    lanes: tuple[Lane, ...]


@dataclass(frozen=True)
class SmException:
    device: int
    sm: int
    exception: int
    error_pc: int | None


@dataclass(frozen=True)
class Meta:
    generator: str
    driver_version: str
    cuda_version: str
    timestamp: int


@dataclass
class CoreDump:
    """Everything the driver's tables say, plus access to the cubins."""

    path: str
    size: int
    devices: list[Device] = field(default_factory=list)
    modules: list[Module] = field(default_factory=list)
    grids: list[Grid] = field(default_factory=list)
    warps: list[Warp] = field(default_factory=list)
    sm_exceptions: list[SmException] = field(default_factory=list)
    meta: Meta | None = None
    notes: list[str] = field(default_factory=list)  # caps hit while reading
    _buf: object = None

    def image(self, module: Module) -> bytes:
        """The module's relocated cubin, copied out of the dump."""
        if module.image is None:
            raise CoreDumpError(f"{self.path}: module {module.index} has no relocated cubin in the dump")
        s = module.image
        return bytes(self._buf[s.offset : s.offset + s.size])  # type: ignore[index]  # buf is bytes or an mmap: both slice and unpack alike

    def region(self, module: Module) -> tuple[object, int, int]:
        """Where the module's cubin lies: (the dump's mapping, offset, size); nothing copied."""
        if module.image is None:
            raise CoreDumpError(f"{self.path}: module {module.index} has no relocated cubin in the dump")
        return self._buf, module.image.offset, module.image.size


@contextlib.contextmanager
def open_dump(path: str | os.PathLike[str]) -> Iterator[CoreDump]:
    """Open and parse a dump; raise CoreDumpError with one line if it is not one."""
    name = os.fspath(path)
    with mapped(name) as buf:
        yield _Parser(name, buf).parse()


class _Parser:
    def __init__(self, path: str, buf: object) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)  # type: ignore[arg-type]  # buf is bytes or an mmap: both have a length
        self.sections: dict[int, Section] = {}  # made when first needed: see section()
        self.shoff = self.shentsize = self.shnum = 0  # the section header table: where, each header's size, how many
        self.names_at = (0, 0)  # the section name table: offset, size
        self.strtab: Section | None = None
        self.notes: list[str] = []
        self.rows_left = MAX_ROWS
        self.lanes_left = MAX_LANES

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def fail(self, why: str) -> CoreDumpError:
        return CoreDumpError(f"{self.path}: {why}")

    # -- the ELF frame ---------------------------------------------------

    def parse(self) -> CoreDump:
        by_type = self._read_sections()
        dump = CoreDump(self.path, self.size, notes=self.notes, _buf=self.buf)
        devtbls = by_type.get(L.SHT_DEV_TABLE, [])
        if len(devtbls) != 1:
            raise self.fail(f"has {len(devtbls)} device tables, expected 1; not a complete CUDA coredump")
        dump.devices = self._devices(devtbls[0])
        dump.modules = self._modules(by_type)
        dump.grids = self._grids(by_type, len(dump.devices))
        dump.warps, dump.sm_exceptions = self._warps(by_type, len(dump.devices))
        metas = by_type.get(L.SHT_META_DATA, [])
        if metas:
            dump.meta = self._meta(metas[0])
        return dump

    def _read_sections(self) -> dict[int, list[Section]]:
        """Check every section header against the file; return the sections we read, by type.

        A hung NCCL kernel leaves 39,000 sections and more (the registers, predicates and
        backtrace of every lane), of which we read a few hundred. The headers are checked a
        run at a time, field by field over their bytes; a Section (and its name) is made only
        for the tables we decode, and the sections they link to."""
        if self.size < EHDR.size:
            raise self.fail(f"only {self.size} bytes, too short to be a CUDA coredump")
        (ident, e_type, machine, _v, _entry, _phoff, shoff, _flags, _ehsize, _phentsize, _phnum, shentsize, shnum,
         shstrndx) = EHDR.unpack(self._read(0, EHDR.size))
        if ident[:4] != b"\x7fELF":
            raise self.fail("not an ELF file, so not a CUDA coredump")
        if ident[4] != 2 or ident[5] != 1:
            raise self.fail("not a 64-bit little-endian ELF file, so not a CUDA coredump")
        if machine != L.EM_CUDA:
            raise self.fail(f"an ELF file for machine {machine}, not EM_CUDA ({L.EM_CUDA}); not a CUDA coredump")
        if e_type != L.ET_CORE:
            kind = "a cubin or CUDA object" if e_type in (1, 2, 3) else f"ELF type {e_type}"
            raise self.fail(f"{kind}, not a CUDA coredump (ET_CORE)")
        if shentsize < SHDR.size:
            raise self.fail(f"section headers of {shentsize} bytes, smaller than ELF's {SHDR.size}; the file is damaged")
        if shoff == 0 or shoff + shentsize > self.size:
            raise self.fail("section header table lies outside the file; the dump is truncated")
        if shnum == 0 or shstrndx == 0xFFFF:
            first = SHDR.unpack(self._read(shoff, SHDR.size))
            shnum = shnum or first[5]
            if shstrndx == 0xFFFF:
                shstrndx = first[6]
        if shnum > MAX_SECTIONS:
            self.note(f"the dump claims {shnum} sections; only the first {MAX_SECTIONS} were read")
            shnum = MAX_SECTIONS
        if shoff + shnum * shentsize > self.size:
            raise self.fail(
                f"claims {shnum} sections at offset {shoff} but the file ends at {self.size}; the dump is truncated"
            )
        if shstrndx >= shnum:
            raise self.fail(f"section name table index {shstrndx} is past the {shnum} sections; the file is damaged")
        self.shoff, self.shentsize, self.shnum = shoff, shentsize, shnum
        names = self._header(shstrndx)
        self._check_range(names[4], names[5], "section name table")
        self.names_at = (names[4], names[5])
        by_type: dict[int, list[Section]] = {}
        for i, typ in self._wanted():
            s = self.section(i)
            by_type.setdefault(typ, []).append(s)
            if typ == SHT_STRTAB and i != shstrndx:
                self.strtab = s
        return by_type

    def _wanted(self) -> list[tuple[int, int]]:
        """(index, type) of each section we read, once every header is checked: its bytes lie
        in the file, its link names a section. A run of headers that fails is gone through
        one by one, to name the first that does, as the file lists them."""
        wanted = []
        for first in range(0, self.shnum, HEADERS_AT_ONCE):
            n = min(HEADERS_AT_ONCE, self.shnum - first)
            if self.shentsize == SHDR.size:
                types, offsets, sizes, links = _columns(self._read(self.shoff + first * SHDR.size, n * SHDR.size))
            else:  # headers padded to another size (a damaged or exotic file): one at a time
                rows = [self._header(first + j) for j in range(n)]
                types, offsets, sizes, links = ([r[k] for r in rows] for k in (1, 4, 5, 6))
            if max(map(operator.add, offsets, sizes)) > self.size or max(links) >= self.shnum:
                for j, (typ, off, size, link) in enumerate(zip(types, offsets, sizes, links)):
                    i = first + j
                    if typ != SHT_NOBITS and i:
                        self._check_range(off, size, f"section {i}")
                    if link >= self.shnum:
                        raise self.fail(f"section {i} links to section {link}, past the {self.shnum} sections; "
                                        "the file is damaged")
            wanted += [(first + j, typ) for j, typ in enumerate(types) if typ in _READ]
        return wanted

    def _header(self, i: int) -> tuple[int, ...]:
        return SHDR.unpack(self._read(self.shoff + i * self.shentsize, SHDR.size))

    def section(self, i: int) -> Section:
        """Section ``i`` (its header checked already), made when first asked for."""
        s = self.sections.get(i)
        if s is None:
            nm, typ, _flg, addr, off, size, link, info, _align, entsize = self._header(i)
            s = Section(i, self._name(nm), typ, addr, off, size, link, info, entsize)
            self.sections[i] = s
        return s

    def _check_range(self, off: int, size: int, what: str) -> None:
        if off + size > self.size:
            raise self.fail(f"{what} claims bytes {off}..{off + size} but the file ends at {self.size}; the dump is truncated or lies about its sizes")

    def _read(self, offset: int, size: int) -> bytes:
        """Bytes of the dump (already checked to lie in it), read through the file where the
        buffer can (see source.Mapping): the mapping is left for the cubins. A page touched
        there maps its neighbours too (fault-around; a whole large folio on ext4 and XFS), so
        the headers and tables of a 123 MB dump, read through it, kept megabytes resident."""
        pread = getattr(self.buf, "pread", None)
        return pread(offset, size) if pread else bytes(self.buf[offset : offset + size])  # type: ignore[index]  # buf is bytes or an mmap: both slice

    def _name(self, at: int) -> str:
        """A section's name, read alone from the name table (a table of 40,000 names is never
        read whole: only the sections we make need theirs)."""
        return self._cstr(*self.names_at, at)

    def _cstr(self, base: int, limit: int, at: int) -> str:
        """The string at ``at`` in the string table at ``base`` (``limit`` bytes), cut at NAME_MAX."""
        if at >= limit:
            return ""
        window = 128
        while True:  # strings are short; a longer one is read again, twice as far
            got = self._read(base + at, min(window, limit - at))
            end = got.find(b"\0")
            if end >= 0 or len(got) < window or window >= NAME_MAX:
                return got[: end if end >= 0 else len(got)].decode("utf-8", "replace")
            window *= 2

    def _string(self, at: int | None) -> str:
        if at is None or self.strtab is None:
            return ""
        return self._cstr(self.strtab.offset, self.strtab.size, at)

    # -- the tables ------------------------------------------------------

    def _rows(self, s: Section, lay: L.Layout) -> list[dict[str, int | None]]:
        entsize = s.entsize or s.size
        if s.size == 0:
            return []
        if entsize < lay.baseline:
            raise self.fail(f"{s.name}: rows of {entsize} bytes, smaller than the {lay.baseline} bytes of any {lay.name}")
        if s.size % entsize:
            raise self.fail(f"{s.name}: {s.size} bytes is not a whole number of {entsize}-byte rows; the section lies about its size")
        count = s.size // entsize
        if count > self.rows_left:
            self.note(f"the dump's tables claim more than {MAX_ROWS} rows; {s.name or 'a table'} and what follows were read only in part")
            count = max(self.rows_left, 0)
        self.rows_left -= count
        if count * entsize <= SMALL:
            data = self._read(s.offset, count * entsize)
            return [lay.decode(data, i * entsize, entsize) for i in range(count)]
        return [lay.decode(self.buf, s.offset + i * entsize, entsize) for i in range(count)]  # type: ignore[arg-type]  # buf is bytes or an mmap: both unpack alike

    def _parent(self, s: Section, expected: int, rows: int | None = None) -> Section:
        parent = self.section(s.link)
        if parent.type != expected:
            raise self.fail(f"{s.name} links to {parent.name or parent.index}, which is not the table it belongs to; the file is damaged")
        if rows is not None and s.info >= rows:
            raise self.fail(f"{s.name} belongs to row {s.info} of {parent.name}, which has only {rows} rows")
        return parent

    def _count(self, s: Section) -> int:
        return s.size // s.entsize if s.entsize else 0

    def _devices(self, s: Section) -> list[Device]:
        out = []
        for i, r in enumerate(self._rows(s, L.DEVICE)):
            out.append(Device(
                index=i,
                name=self._string(r["devName"]),
                type=self._string(r["devType"]),
                sm_type=self._string(r["smType"]),
                num_sms=r["numSMs"] or 0,
                warps_per_sm=r["numWarpsPerSM"] or 0,
                lanes_per_warp=r["numLanesPerWarp"] or 0,
                sm_version=f"{r['smMajor']}.{r['smMinor']}",
            ))
        return out

    def _modules(self, by_type: dict[int, list[Section]]) -> list[Module]:
        images: dict[tuple[int, int], Section] = {}
        for img in by_type.get(L.SHT_RELF_IMG, []):
            images[(img.link, img.info)] = img
        out = []
        for modtbl in by_type.get(L.SHT_MOD_TABLE, []):
            ctx = self._parent(modtbl, L.SHT_CTX_TABLE)
            self._parent(ctx, L.SHT_DEV_TABLE)
            for i, r in enumerate(self._rows(modtbl, L.MODULE)):
                out.append(Module(ctx.info, modtbl.info, i, r["moduleHandle"] or 0, images.get((modtbl.index, i))))
        return out

    def _grids(self, by_type: dict[int, list[Section]], ndev: int) -> list[Grid]:
        out = []
        for s in by_type.get(L.SHT_GRID_TABLE, []):
            self._parent(s, L.SHT_DEV_TABLE, ndev)
            for i, r in enumerate(self._rows(s, L.GRID)):
                out.append(Grid(
                    device=s.info,
                    index=i,
                    grid_id=r["gridId64"] or 0,
                    context_id=r["contextId"] or 0,
                    function_entry=r["functionEntry"] or 0,
                    module_handle=r["moduleHandle"] or 0,
                    status=L.GRID_STATUS.get(r["gridStatus"] or 0, f"status {r['gridStatus']}"),
                    grid_dim=(r["gridDimX"] or 0, r["gridDimY"] or 0, r["gridDimZ"] or 0),
                    block_dim=(r["blockDimX"] or 0, r["blockDimY"] or 0, r["blockDimZ"] or 0),
                    host_tid=r["attrHostTid"] or 0,
                ))
        return out

    def _warps(self, by_type: dict[int, list[Section]], ndev: int) -> tuple[list[Warp], list[SmException]]:
        sm_ids: dict[tuple[int, int], int] = {}
        sm_exc: list[SmException] = []
        for s in by_type.get(L.SHT_SM_TABLE, []):
            self._parent(s, L.SHT_DEV_TABLE, ndev)
            for i, r in enumerate(self._rows(s, L.SM)):
                sm_ids[(s.index, i)] = r["smId"] or 0
                if r["exception"]:
                    pc = r["errorPC"] if r["errorPCValid"] else None
                    sm_exc.append(SmException(s.info, r["smId"] or 0, r["exception"], pc))
        ctas: dict[tuple[int, int], tuple[int, int, int, tuple[int, int, int]]] = {}
        for s in by_type.get(L.SHT_CTA_TABLE, []):
            smtbl = self._parent(s, L.SHT_SM_TABLE, self._count(self.section(s.link)))
            if (smtbl.index, s.info) not in sm_ids:
                continue  # its SM row lay past the row cap
            sm = sm_ids[(smtbl.index, s.info)]
            for i, r in enumerate(self._rows(s, L.CTA)):
                ctas[(s.index, i)] = (smtbl.info, sm, r["gridId64"] or 0, (r["blockIdxX"] or 0, r["blockIdxY"] or 0, r["blockIdxZ"] or 0))
        lane_tables: dict[tuple[int, int], Section] = {}
        for s in by_type.get(L.SHT_LN_TABLE, []):
            lane_tables[(s.link, s.info)] = s
        warps = []
        for s in by_type.get(L.SHT_WP_TABLE, []):
            self._parent(s, L.SHT_CTA_TABLE, self._count(self.section(s.link)))
            if (s.link, s.info) not in ctas:
                continue  # its CTA row lay past the row cap
            device, sm, grid_id, block = ctas[(s.link, s.info)]
            for i, r in enumerate(self._rows(s, L.WARP)):
                lanes = self._lanes(lane_tables.get((s.index, i)))
                warps.append(Warp(
                    device=device, sm=sm, grid_id=grid_id, block_idx=block,
                    warp_id=r["warpId"] or 0,
                    valid_mask=r["validLanesMask"] or 0,
                    active_mask=r["activeLanesMask"] or 0,
                    error_pc=r["errorPC"] if r["errorPCValid"] else None,
                    lanes=lanes,
                ))
        return warps, sm_exc

    def _lanes(self, s: Section | None) -> tuple[Lane, ...]:
        if s is None or s.size == 0:
            return ()
        entsize = s.entsize
        if entsize < L.LANE.baseline:
            raise self.fail(f"{s.name}: rows of {entsize} bytes, smaller than the {L.LANE.baseline} bytes of any lane table")
        if s.size % entsize:
            raise self.fail(f"{s.name}: {s.size} bytes is not a whole number of {entsize}-byte rows; the section lies about its size")
        count = s.size // entsize
        if count > MAX_LANES_PER_WARP:
            self.note(f"{s.name or 'a lane table'} claims {count} lanes for one warp; only the first {MAX_LANES_PER_WARP} were read")
            count = MAX_LANES_PER_WARP
        if count > self.lanes_left:
            self.note(f"the dump's lane tables claim more than {MAX_LANES} lanes; the rest were not read")
            count = max(self.lanes_left, 0)
        self.lanes_left -= count
        # The hot loop of a big dump: one precompiled struct over the whole section.
        row = struct.Struct(f"<QQIIIII{entsize - 36}x")
        data = self._read(s.offset, count * entsize)
        return tuple(
            Lane(ln, pc, (tx, ty, tz), exc)
            for pc, _phys, ln, tx, ty, tz, exc in row.iter_unpack(data)
        )

    def _meta(self, s: Section) -> Meta | None:
        rows = self._rows(s, L.META)
        if not rows:
            return None
        r = rows[0]
        return Meta(
            generator=self._string(r["generatorName"]),
            driver_version=f"{r['driverVersionMajor']}.{r['driverVersionMinor']}",
            cuda_version=f"{r['cudaDriverVersionMajor']}.{r['cudaDriverVersionMinor']}",
            timestamp=r["timestamp"] or 0,
        )
