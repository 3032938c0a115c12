"""A symbolised CUDA coredump as text, like a ``py-spy dump`` of the GPU."""

from __future__ import annotations

from collections.abc import Iterable

from ..cudacore.symbolize import Frame, Symbolized
from .names import Folder
from .terminal import escape_lines


def _lanes(lanes: Iterable[int]) -> str:
    """0,1,2,3,7 -> '0-3,7'."""
    out: list[str] = []
    run: list[int] = []
    for ln in sorted(lanes):
        if run and ln != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(ln)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _dim(d: Iterable[int]) -> str:
    return "(" + ",".join(str(x) for x in d) + ")"


def _frames(frames: tuple[Frame, ...], names: Folder, indent: str = "    ") -> list[str]:
    if not frames:
        return [f"{indent}(no function of the dump's cubins holds this PC)"]
    out = []
    for i, f in enumerate(frames):
        where = f"{f.file}:{f.line}" if f.file else "no line information"
        kind = "" if i == len(frames) - 1 else "  [inlined]"
        out.append(f"{indent}{names.name(f.function) or '??'} ({where}){kind}")
    return out


def render(s: Symbolized) -> str:
    names = Folder()  # a templated kernel's name can run past 1,000 characters: shown whole once, at the end
    lines = [f"CUDA coredump {s.path} ({s.size / 1e6:.1f} MB" + (f", driver {s.driver})" if s.driver else ")")]
    for d in s.devices:
        lines.append(f"  device {d['index']}: {d['name']} ({d['sm_type']}, {d['num_sms']} SMs)")
    for e in s.exceptions:
        lanes = f", lanes {_lanes(e.lanes)}" if e.lanes else ""
        warp = f", warp {e.warp}" if e.warp >= 0 else " (the faulting warps had exited)"
        lines += ["", f"Exception {e.type} on device {e.device}, SM {e.sm}{warp}{lanes}"]
        if e.block_idx is not None:
            lines.append(f"  block {_dim(e.block_idx)}, thread {_dim(e.thread_idx or ())}")
        pc_kind = "error PC" if e.error_pc_valid else "PC (the driver gave no error PC)"
        lines.append(f"  at {pc_kind} {e.pc:#x} in {names.name(e.kernel) or 'an unknown kernel'}")
        lines += _frames(e.frames, names)
    if not s.kernels:
        lines += ["", "No kernel was running on any device when the dump was taken."]
    for k in s.kernels:
        lines += ["", f"Kernel {names.name(k.name)}", f"  device {k.device}, grid {_dim(k.grid_dim)}, block {_dim(k.block_dim)}, {k.status}, "
                  f"SMs {','.join(map(str, k.sms)) or 'none'}"]
        mine = [p for p in s.pcs if p.device == k.device and p.kernel == k.name]
        for p in mine:
            blocks = " ".join(_dim(b) for b in p.blocks[:8]) + (" ..." if len(p.blocks) > 8 else "")
            lines.append(f"  {p.warps} warp{'s' if p.warps != 1 else ''}, {p.lanes} lanes at PC {p.pc:#x} "
                         f"(SMs {','.join(map(str, p.sms))}; blocks {blocks})")
            lines += _frames(p.frames, names)
    orphans = [p for p in s.pcs if p.kernel is None]
    for p in orphans:
        lines += ["", f"{p.warps} warps on device {p.device} at PC {p.pc:#x}, of no grid in the dump"]
        lines += _frames(p.frames, names)
    if s.notes:
        lines += ["", "Notes:"] + [f"  - {n}" for n in s.notes]
    if s.cuda_gdb is not None:
        lines += ["", "cuda-gdb says:"] + ["  " + ln for ln in s.cuda_gdb.splitlines()]
    lines += names.in_full()
    return escape_lines("\n".join(lines)) + "\n"  # kernel and symbol names come from the dump
