"""Reading a CUDA coredump: the ELF frame, then the driver's tables.

The outer ELF is walked by hand with ``struct`` over a read-only mapping:
a dump holds tens of thousands of sections, every offset and size is
checked against the file before it is used, and nothing is copied but the
rows we decode and the cubins we are asked for.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
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


@dataclass(frozen=True)
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
        self.size = len(buf)  # type: ignore[arg-type]  # buf is bytes or an mmap: both slice and unpack alike
        self.sections: list[Section] = []
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
        self._read_sections()
        dump = CoreDump(self.path, self.size, notes=self.notes, _buf=self.buf)
        by_type: dict[int, list[Section]] = {}
        for s in self.sections:
            by_type.setdefault(s.type, []).append(s)
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

    def _read_sections(self) -> None:
        if self.size < EHDR.size:
            raise self.fail(f"only {self.size} bytes, too short to be a CUDA coredump")
        ident, e_type, machine, _v, _entry, _phoff, shoff, _flags, _ehsize, _phentsize, _phnum, shentsize, shnum, shstrndx = EHDR.unpack_from(self.buf, 0)  # type: ignore[arg-type]  # buf is bytes or an mmap: both slice and unpack alike
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
            first = SHDR.unpack_from(self.buf, shoff)  # type: ignore[arg-type]  # buf is bytes or an mmap: both slice and unpack alike
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
        raw = [SHDR.unpack_from(self.buf, shoff + i * shentsize) for i in range(shnum)]  # type: ignore[arg-type]  # buf is bytes or an mmap: both slice and unpack alike
        if shstrndx >= shnum:
            raise self.fail(f"section name table index {shstrndx} is past the {shnum} sections; the file is damaged")
        names = raw[shstrndx]
        self._check_range(names[4], names[5], "section name table")
        names_off, names_size = names[4], names[5]
        for i, (nm, typ, _flg, addr, off, size, link, info, _align, entsize) in enumerate(raw):
            if typ != SHT_NOBITS and i:
                self._check_range(off, size, f"section {i}")
            if link >= shnum:
                raise self.fail(f"section {i} links to section {link}, past the {shnum} sections; the file is damaged")
            name = self._cstr(names_off, names_size, nm)
            self.sections.append(Section(i, name, typ, addr, off, size, link, info, entsize))
        for s in self.sections:
            if s.type == SHT_STRTAB and s.index != shstrndx:
                self.strtab = s

    def _check_range(self, off: int, size: int, what: str) -> None:
        if off + size > self.size:
            raise self.fail(f"{what} claims bytes {off}..{off + size} but the file ends at {self.size}; the dump is truncated or lies about its sizes")

    def _cstr(self, base: int, limit: int, at: int) -> str:
        if at >= limit:
            return ""
        start = base + at
        end = self.buf.find(b"\0", start, base + limit)  # type: ignore[attr-defined]  # buf is bytes or an mmap: both slice and unpack alike
        if end < 0:
            end = base + limit
        return bytes(self.buf[start:end]).decode("utf-8", "replace")  # type: ignore[index]  # buf is bytes or an mmap: both slice and unpack alike

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
        return [lay.decode(self.buf, s.offset + i * entsize, entsize) for i in range(count)]  # type: ignore[arg-type]  # buf is bytes or an mmap: both slice and unpack alike

    def _parent(self, s: Section, expected: int, rows: int | None = None) -> Section:
        parent = self.sections[s.link]
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
            smtbl = self._parent(s, L.SHT_SM_TABLE, self._count(self.sections[s.link]))
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
            self._parent(s, L.SHT_CTA_TABLE, self._count(self.sections[s.link]))
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
        data = self.buf[s.offset : s.offset + count * entsize]  # type: ignore[index]  # buf is bytes or an mmap: both slice and unpack alike
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
