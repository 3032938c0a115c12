"""From a coredump's raw tables to what an engineer asks first: which kernels
ran, where every warp was, which lane faulted, and the whole inline chain."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from . import layout as L
from .cubin import Cubin, Function, demangle
from .errors import CoreDumpError
from .linetable import LineTable
from .nvdisasm import INSTALL_HINT, NvdisasmError, SourceLine, find_nvdisasm, line_table
from .reader import CoreDump, Grid, Module, open_dump


@dataclass(frozen=True)
class Frame:
    function: str | None
    file: str | None
    line: int | None


@dataclass(frozen=True)
class Kernel:
    device: int
    grid_id: int
    name: str
    mangled: str
    grid_dim: tuple[int, int, int]
    block_dim: tuple[int, int, int]
    status: str
    sms: tuple[int, ...]


@dataclass(frozen=True)
class GpuException:
    type: str
    device: int
    sm: int
    warp: int
    lanes: tuple[int, ...]
    pc: int
    error_pc_valid: bool
    block_idx: tuple[int, int, int] | None
    thread_idx: tuple[int, int, int] | None
    kernel: str | None
    frames: tuple[Frame, ...]
    frames_from: str | None = None  # "line-table", "nvdisasm", or None: no source lines


@dataclass(frozen=True)
class PcGroup:
    device: int
    kernel: str | None
    pc: int
    warps: int
    lanes: int
    sms: tuple[int, ...]
    blocks: tuple[tuple[int, int, int], ...]
    frames: tuple[Frame, ...]
    frames_from: str | None = None


@dataclass(frozen=True)
class Symbolized:
    path: str
    size: int
    driver: str | None
    devices: tuple[dict[str, object], ...]
    kernels: tuple[Kernel, ...]
    exceptions: tuple[GpuException, ...]
    pcs: tuple[PcGroup, ...]
    notes: tuple[str, ...]
    cuda_gdb: str | None = None

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        for group in ("exceptions", "pcs"):
            for item in d[group]:
                item["pc"] = hex(item["pc"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Symbolized:
        """The inverse of to_dict, checking every type: the dict comes from a child
        process that read a hostile dump. Raises ValueError (or TypeError, KeyError)."""

        def ints(v: Any) -> tuple[int, ...]:
            return tuple(_int(x) for x in v)

        def frames(v: Any) -> tuple[Frame, ...]:
            return tuple(Frame(_opt(f["function"], str), _opt(f["file"], str), _opt(f["line"], int)) for f in v)

        return cls(
            path=_str(d["path"]), size=_int(d["size"]), driver=_opt(d["driver"], str),
            devices=tuple({str(k): v for k, v in _dict(dev).items() if isinstance(v, (int, str))}
                          for dev in d["devices"]),
            kernels=tuple(Kernel(
                device=_int(k["device"]), grid_id=_int(k["grid_id"]), name=_str(k["name"]), mangled=_str(k["mangled"]),
                grid_dim=_dim3(k["grid_dim"]), block_dim=_dim3(k["block_dim"]), status=_str(k["status"]),
                sms=ints(k["sms"])) for k in d["kernels"]),
            exceptions=tuple(GpuException(
                type=_str(e["type"]), device=_int(e["device"]), sm=_int(e["sm"]), warp=_int(e["warp"]),
                lanes=ints(e["lanes"]), pc=int(_str(e["pc"]), 16), error_pc_valid=bool(e["error_pc_valid"]),
                block_idx=None if e["block_idx"] is None else _dim3(e["block_idx"]),
                thread_idx=None if e["thread_idx"] is None else _dim3(e["thread_idx"]),
                kernel=_opt(e["kernel"], str), frames=frames(e["frames"]), frames_from=_opt(e.get("frames_from"), str),
            ) for e in d["exceptions"]),
            pcs=tuple(PcGroup(
                device=_int(p["device"]), kernel=_opt(p["kernel"], str), pc=int(_str(p["pc"]), 16),
                warps=_int(p["warps"]), lanes=_int(p["lanes"]), sms=ints(p["sms"]),
                blocks=tuple(_dim3(b) for b in p["blocks"]), frames=frames(p["frames"]),
                frames_from=_opt(p.get("frames_from"), str),
            ) for p in d["pcs"]),
            notes=tuple(_str(n) for n in d["notes"]),
            cuda_gdb=_opt(d.get("cuda_gdb"), str),
        )


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _opt(v: Any, kind: type) -> Any:
    if v is None:
        return None
    return _int(v) if kind is int else _str(v)


def _dict(v: Any) -> dict[Any, Any]:
    if not isinstance(v, dict):
        raise TypeError(f"expected an object, got {type(v).__name__}")
    return v


def _dim3(v: Any) -> tuple[int, int, int]:
    x, y, z = v
    return (_int(x), _int(y), _int(z))


@dataclass
class _Resolver:
    """Turns (device, pc) into a kernel name and frames, caching per module and function."""

    dump: CoreDump
    strict: bool
    nvdisasm: str | None  # "auto": looked for on first need
    chains: str = "line-table"
    notes: list[str] = field(default_factory=list)
    # Keyed by where the cubin lies in the dump: a hostile dump may point many modules
    # at the same bytes, and each is read once.
    _cubins: dict[tuple[int, int], Cubin] = field(default_factory=dict)
    _tables: dict[tuple[int, int], LineTable] = field(default_factory=dict)
    _lines: dict[tuple[tuple[int, int], int], dict[int, tuple[SourceLine, ...]]] = field(default_factory=dict)
    _frames: dict[tuple[int, int], tuple[tuple[Frame, ...], str | None]] = field(default_factory=dict)

    def tool(self) -> str | None:
        """nvdisasm, looked for only when a chain needs it: most dumps' line tables answer alone."""
        if self.nvdisasm == "auto":
            self.nvdisasm = find_nvdisasm()
        return self.nvdisasm

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def cubin(self, module: Module) -> Cubin:
        key = _where(module)
        if key not in self._cubins:
            cubin = Cubin(*self.dump.region(module)) if module.image else Cubin(b"")  # type: ignore[arg-type]  # a region of the dump (bytes or an mmap)
            if cubin.error and module.image:
                self.fail_or_note(f"module {module.index} on device {module.device}: {cubin.error}")
            self._cubins[key] = cubin
        return self._cubins[key]

    def fail_or_note(self, text: str) -> None:
        if self.strict:
            raise CoreDumpError(f"{self.dump.path}: {text}")
        self.note(text)

    def locate(self, device: int, pc: int, hint: Module | None) -> tuple[Module, Function] | None:
        candidates = [hint] if hint else []
        candidates += [m for m in self.dump.modules if m.device == device and m is not hint]
        tried: set[tuple[int, int]] = set()
        for module in candidates:
            if _where(module) in tried:
                continue
            tried.add(_where(module))
            fn = self.cubin(module).function_at(pc)
            if fn:
                return module, fn
        return None

    def frames(self, device: int, pc: int, hint: Module | None) -> tuple[tuple[Frame, ...], str | None]:
        """The chain at a PC, innermost first, and where it came from ("line-table",
        "nvdisasm", or None when there are no source lines)."""
        key = (device, pc)
        if key not in self._frames:
            self._frames[key] = self._resolve(device, pc, hint)
        return self._frames[key]

    def _resolve(self, device: int, pc: int, hint: Module | None) -> tuple[tuple[Frame, ...], str | None]:
        found = self.locate(device, pc, hint)
        if not found:
            self.note(f"PC {pc:#x} on device {device} lies in no loaded function of the dump's cubins")
            return (), None
        module, fn = found
        bare = (Frame(fn.name, None, None),)
        if not fn.has_line_info:
            self.note(f"{_short(fn.name)}: its cubin has no line information (compile with -lineinfo for source lines)")
            return bare, None
        if self.chains == "line-table":
            table = self._table(module)
            located = table.chain_at(pc)
            if located:
                last = len(located) - 1
                return tuple(Frame(fn.name if i == last else (demangle(loc.function) if loc.function else None),
                                   loc.file, loc.line) for i, loc in enumerate(located)), "line-table"
            # Said aloud, never silent: a chain from nvdisasm is no check of our reader.
            if table.error:
                self.note(f"module {module.index} on device {module.device}: its line table cannot be read "
                          f"({table.error}); chains there come from nvdisasm")
            else:
                self.note(f"PC {pc:#x} ({_short(fn.name)}): no row of its line table holds it; "
                          "its chain comes from nvdisasm")
        if self.tool() is None:
            self.note(f"nvdisasm not found, so no source lines for this cubin; {INSTALL_HINT}")
            return bare, None
        chain = self._chain(module, fn, pc)
        if not chain:
            return bare, None
        last = len(chain) - 1
        return tuple(Frame(fn.name if i == last else None, src.file, src.line) for i, src in enumerate(chain)), "nvdisasm"

    def _chain(self, module: Module, fn: Function, pc: int) -> tuple[SourceLine, ...]:
        key = (_where(module), fn.symbol_index)
        if key not in self._lines:
            try:
                self._lines[key] = line_table(self.nvdisasm or "", self.dump.image(module), fn.symbol_index)
            except NvdisasmError as exc:
                self.fail_or_note(f"module {module.index} ({_short(fn.name)}): {exc}")
                self._lines[key] = {}
        return self._lines[key].get(pc, ())

    def _table(self, module: Module) -> LineTable:
        key = _where(module)
        if key not in self._tables:
            self._tables[key] = LineTable(*self.dump.region(module))  # type: ignore[arg-type]  # a region of the dump (bytes or an mmap)
        return self._tables[key]


def symbolize(path: str | os.PathLike[str], strict: bool = True, nvdisasm: str | None = "auto",
              chains: str = "line-table") -> Symbolized:
    """Read the dump at ``path``.

    strict: a damaged cubin is an error, not a note. chains: "line-table" reads the
    cubins' line tables directly (nvdisasm only where that fails); "nvdisasm" asks
    nvdisasm for every chain, as a cross-check.
    """
    with open_dump(path) as dump:
        r = _Resolver(dump, strict, nvdisasm, chains, notes=list(dump.notes))
        grids = {(g.device, g.grid_id): g for g in dump.grids}
        by_handle: dict[tuple[int, int], Module] = {}
        for m in dump.modules:
            by_handle.setdefault((m.device, m.handle), m)
        modules = {(g.device, g.grid_id): by_handle.get((g.device, g.module_handle)) for g in dump.grids}
        sms_of: dict[tuple[int, int], set[int]] = defaultdict(set)
        for w in dump.warps:
            sms_of[(w.device, w.grid_id)].add(w.sm)
        kernels = {key: _kernel(r, g, modules[key], sms_of[key]) for key, g in grids.items()}

        def kernel_name(device: int, grid_id: int) -> str | None:
            k = kernels.get((device, grid_id))
            return k.name if k else None

        exceptions: list[GpuException] = []
        faulted_sms: set[tuple[int, int]] = set()
        groups: dict[tuple[int, int], dict[str, object]] = {}
        for w in dump.warps:
            hint = modules.get((w.device, w.grid_id))
            by_exc: dict[int, list[int]] = defaultdict(list)
            by_pc: dict[int, int] = defaultdict(int)
            for lane in w.lanes:
                by_pc[lane.pc] += 1
                if lane.exception:
                    by_exc[lane.exception].append(lane.lane)
            for code, lanes in sorted(by_exc.items()):
                first = next(ln for ln in w.lanes if ln.lane == lanes[0])
                pc = w.error_pc if w.error_pc is not None else first.pc
                faulted_sms.add((w.device, w.sm))
                frames, frames_from = r.frames(w.device, pc, hint)
                exceptions.append(GpuException(
                    type=L.exception_name(code), device=w.device, sm=w.sm, warp=w.warp_id,
                    lanes=tuple(lanes), pc=pc, error_pc_valid=w.error_pc is not None,
                    block_idx=w.block_idx, thread_idx=first.thread_idx,
                    kernel=kernel_name(w.device, w.grid_id), frames=frames, frames_from=frames_from,
                ))
            for pc, nlanes in by_pc.items():
                g = groups.setdefault((w.device, pc), {
                    "kernel": kernel_name(w.device, w.grid_id), "hint": hint,
                    "warps": 0, "lanes": 0, "sms": set(), "blocks": set(),
                })
                g["warps"] += 1  # type: ignore[operator]  # the group\'s dict holds several types
                g["lanes"] += nlanes  # type: ignore[operator]  # the group\'s dict holds several types
                g["sms"].add(w.sm)  # type: ignore[attr-defined]  # the group\'s dict holds several types
                g["blocks"].add(w.block_idx)  # type: ignore[attr-defined]  # the group\'s dict holds several types
        for se in dump.sm_exceptions:
            if (se.device, se.sm) in faulted_sms:
                continue
            # Every faulting warp already exited: the SM still remembers the exception.
            frames, frames_from = r.frames(se.device, se.error_pc, None) if se.error_pc is not None else ((), None)
            exceptions.append(GpuException(
                type=L.exception_name(se.exception), device=se.device, sm=se.sm, warp=-1, lanes=(),
                pc=se.error_pc or 0, error_pc_valid=se.error_pc is not None, block_idx=None,
                thread_idx=None, kernel=None, frames=frames, frames_from=frames_from,
            ))
        pcs = []
        for (dev, pc), g in groups.items():
            frames, frames_from = r.frames(dev, pc, g["hint"])  # type: ignore[arg-type]  # the group's dict holds several types
            pcs.append(PcGroup(
                device=dev, kernel=g["kernel"], pc=pc, warps=g["warps"], lanes=g["lanes"],  # type: ignore[arg-type]  # as above
                sms=tuple(sorted(g["sms"])), blocks=tuple(sorted(g["blocks"])),  # type: ignore[call-overload]  # as above
                frames=frames, frames_from=frames_from,
            ))
        pcs.sort(key=lambda p: (-p.warps, -p.lanes, p.device, p.pc))
        devices = tuple(
            {"index": d.index, "name": d.name, "sm_type": d.sm_type, "num_sms": d.num_sms,
             "warps_per_sm": d.warps_per_sm, "lanes_per_warp": d.lanes_per_warp}
            for d in dump.devices
        )
        return Symbolized(
            path=dump.path, size=dump.size,
            driver=dump.meta.driver_version if dump.meta else None,
            devices=devices, kernels=tuple(kernels.values()), exceptions=tuple(exceptions),
            pcs=tuple(pcs), notes=tuple(r.notes),
        )


def _kernel(r: _Resolver, g: Grid, module: Module | None, sms: set[int]) -> Kernel:
    mangled = f"<function at {g.function_entry:#x}>"
    if module is not None:
        fn = r.cubin(module).function_at(g.function_entry)
        if fn:
            mangled = fn.mangled
    return Kernel(
        device=g.device, grid_id=g.grid_id, name=demangle(mangled), mangled=mangled,
        grid_dim=g.grid_dim, block_dim=g.block_dim, status=g.status, sms=tuple(sorted(sms)),
    )


def _where(module: Module) -> tuple[int, int]:
    s = module.image
    return (s.offset, s.size) if s is not None else (-1, module.index)


def _short(name: str, limit: int = 80) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."
