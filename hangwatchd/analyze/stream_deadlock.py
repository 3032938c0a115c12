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
    """The dump's kernels on the process's GPUs (all of them where those are not known)."""
    kernels = [k for k in dicts(symbolized.get("kernels")) if isinstance(k.get("name"), str)]
    return [k for k in kernels if not gpus or k.get("device") in gpus]


def idle_gpu(symbolized: dict[str, Any], nvml: dict[str, Any]) -> str | None:
    """Why the process's GPU runs nothing, if the dump or NVML says so; None when nothing says it."""
    gpus = process_gpus(nvml)
    devices = dicts(symbolized.get("devices"))
    where = f"GPU {', '.join(map(str, gpus))}" if gpus else "the process's GPUs"
    if devices and not kernels_on(symbolized, gpus):
        return f"the GPU dump shows no kernel running on {where}"
    utilisation = [d.get("utilization_percent") for d in dicts(nvml.get("devices")) if d.get("index") in gpus]
    known = [u for u in utilisation if isinstance(u, (int, float)) and not isinstance(u, bool)]
    if gpus and known and len(known) == len(utilisation) and max(known) == 0 and not devices:
        return f"NVML reads 0 % on {where}"
    return None
