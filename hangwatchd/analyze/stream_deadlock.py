"""A host blocked in the CUDA driver while its GPU runs nothing: a stream deadlock.

When the host waits in the driver (a synchronize, or a launch behind a full
queue) and a kernel spins, the kernel is the story. When it waits and the
GPU dump shows no kernel on the process's device (or NVML reads 0 %), the
host waits for work that is never run: a stream waits on an event or a value
nothing will signal, or the launch queue sits behind such a stream. Those
two read alike in the stack and need opposite looks.
"""

from __future__ import annotations

import re
from typing import Any

from ..detect import patterns
from .evidence import as_int, dicts
from .stacks import library_frames

WHAT_TO_LOOK_AT = ("look at what the stream waits for: cudaStreamWaitEvent on an event never recorded, "
                   "cudaStreamWaitValue/cuStreamWaitValue32 on a value nothing writes, "
                   "a CUDA graph node whose dependency never runs, a stream waiting on another process's work")
_HEX = re.compile(r"^0x[0-9a-fA-F]+$")
# Where a launch loads its kernel: CUDA's lazy loading (the default since CUDA 12.2) loads a kernel at
# its first launch, and the load can wait for the work already queued on the device to finish.
LAZY_LOAD = re.compile(r"^cu(?:KernelGetFunction|LibraryGetKernel|LibraryLoad\w*|ModuleGetFunction|ModuleLoad\w*)$")
LAZY_NOTE = ("loading a kernel at its first launch: CUDA's lazy loading can wait for the work already queued on "
             "the device, so the launch waits behind the stuck stream (CUDA_MODULE_LOADING=EAGER loads kernels at start)")


def driver_call(threads: tuple[dict[str, Any], ...]) -> str | None:
    """The driver call the host is blocked in: a named wait, else the innermost named libcuda frame."""
    frames = [f for t in threads for f in t.get("frames") or []]
    named = patterns.first((str(f.get("name") or "") for f in frames), (patterns.GPU_NATIVE,))
    if named:
        return named
    for f in library_frames(list(threads), (patterns.DRIVER_LIBRARY,)):
        name = str(f.get("name") or "")
        if name and not _HEX.match(name):
            return name
    return None


def process_gpus(nvml: dict[str, Any]) -> list[int]:
    gpus = nvml.get("process_gpus")
    return [g for g in gpus if as_int(g) is not None] if isinstance(gpus, list) else []


def kernels_on(symbolized: dict[str, Any], gpus: list[int]) -> list[dict[str, Any]]:
    """The dump's kernels running on the process's GPUs (all of them where those are not known).

    A grid the dump lists as pending or terminated, with no warp on any SM, is not running: a
    launch queued behind a stream wait shows up so.
    """
    kernels = [k for k in dicts(symbolized.get("kernels")) if isinstance(k.get("name"), str) and _running(k)]
    return [k for k in kernels if not gpus or k.get("device") in gpus]


def _running(kernel: dict[str, Any]) -> bool:
    status = kernel.get("status")
    return bool(kernel.get("sms")) or status not in ("pending", "terminated", "invalid")


def own_utilisation(nvml: dict[str, Any]) -> dict[int, float]:
    """This process's own SM utilisation on each of its GPUs (NVML's per-process samples); empty when not measured."""
    raw = nvml.get("process_sm_percent")
    out: dict[int, float] = {}
    for k, v in (raw.items() if isinstance(raw, dict) else ()):
        if str(k).isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[int(k)] = v
    return out


def device_utilisation(nvml: dict[str, Any]) -> dict[int, float]:
    """Each GPU's utilisation as NVML reads it device-wide: every process on it together."""
    out: dict[int, float] = {}
    for d in dicts(nvml.get("devices")):
        u, i = d.get("utilization_percent"), as_int(d.get("index"))
        if i is not None and isinstance(u, (int, float)) and not isinstance(u, bool):
            out[i] = u
    return out


def others_on(nvml: dict[str, Any], gpu: int, pid: int | None) -> list[int]:
    """The other processes NVML saw on ``gpu``."""
    for d in dicts(nvml.get("devices")):
        if d.get("index") == gpu:
            return [p["pid"] for p in dicts(d.get("processes")) if as_int(p.get("pid")) is not None and p["pid"] != pid]
    return []


def busy_text(nvml: dict[str, Any], gpus: list[int], pid: int | None = None) -> str:
    """How busy the process keeps its GPUs, for a verdict: its own share first, the device's as context."""
    own, device = own_utilisation(nvml), device_utilisation(nvml)
    mine = [g for g in gpus if g in own]
    if mine:
        parts = []
        for g in mine:
            ctx = f", device {device[g]:g}% busy with all its processes" if g in device else ""
            parts.append(f"GPU {g}: this process {own[g]:g}%{ctx}")
        return ", " + "; ".join(parts)
    top = max((device[g] for g in gpus if g in device), default=0.0)
    return f", GPU {top:g}% busy (device-wide, all processes)" if top else ""


def idle_gpu(symbolized: dict[str, Any], nvml: dict[str, Any], pid: int | None = None) -> str | None:
    """Why the process's GPU runs nothing for it, if the dump or NVML says so; None when nothing says it.

    Device-wide utilisation is every process's together: on a GPU shared with a busy neighbour it
    reads 100 % while this process runs nothing, so it only says "idle" at 0 %, and is otherwise
    told as context.
    """
    gpus = process_gpus(nvml)
    devices = dicts(symbolized.get("devices"))
    where = f"GPU {', '.join(map(str, gpus))}" if gpus else "the process's GPUs"
    device = device_utilisation(nvml)
    shared = "".join(f"; GPU {g} is shared, {device[g]:g}% busy with other processes "
                     f"({', '.join(map(str, others_on(nvml, g, pid))) or 'pids unknown'})" for g in gpus if device.get(g))
    if devices and not kernels_on(symbolized, gpus):
        return f"the GPU dump shows no kernel running on {where}{shared}"
    if devices:
        return None  # the dump shows a kernel running: it is the story, whatever NVML sampled
    own = own_utilisation(nvml)
    if gpus and all(g in own for g in gpus) and max(own[g] for g in gpus) == 0:
        return f"NVML's per-process samples show this process running nothing on {where}{shared}"
    known = [device[g] for g in gpus if g in device]
    if gpus and known and len(known) == len(gpus) and max(known) == 0:
        return f"NVML reads 0 % on {where}"
    return None
