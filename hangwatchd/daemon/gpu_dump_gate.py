"""The GPU-dump gate: may this capture take a CUDA coredump, which ends the process?

Policy ``always`` and ``never`` say so plainly. ``confirmed`` (the default)
wants two signals that agree (the heartbeat and the stack), or one thread the
capture found waiting on the GPU or a collective: a dump is the one step that
cannot be taken back.

What the gate believes is what a user cannot forge by naming things:
- only native frames count, frames py-spy found in a loaded library (``module``
  set), never a Python function's name (``def cuStreamSynchronize(): sleep()``
  is a Python frame) nor a frame of a ``.py`` file;
- a capture another node asked for through the shared store (``job-request``)
  never takes a GPU dump, whatever the policy: a request in the store alone
  may be forged by anyone who can write there, and the dump ends the process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from ..analyze.jsonfile import Unreadable, read_json
from ..analyze.stacks import MAX_STACK_BYTES
from ..detect import patterns

log = structlog.get_logger("hangwatchd.daemon")

FROM_STORE = "job-request"  # the suspicion of a capture asked for through the shared store


def gpu_dump_veto(policy: str, outdir: Path, signals: tuple[str, ...] = (), reason: str | None = None) -> str | None:
    """Why not to take a GPU dump of the process captured into ``outdir``; None means take it.

    ``reason`` is the suspicion's (``job-request``: asked for through the store)."""
    if reason == FROM_STORE:
        return ("asked for through the shared store only: a request there never takes a GPU dump "
                "(it ends the process); this node's own signals did not say hung")
    if policy == "always":
        return None
    if policy == "never":
        return "gpu_dump = never"
    if {"heartbeat", "stack"} <= set(signals):
        log.info("gpu_dump_confirmed", dir=str(outdir), signals=list(signals))
        return None
    waiting = native_gpu_wait(outdir)
    if waiting:
        log.info("gpu_dump_confirmed", dir=str(outdir), frame=waiting)
        return None
    return ("not confirmed: only one signal, and no thread's native stack waits on the GPU or a collective "
            "(gpu_dump = confirmed)")


def is_native(frame: dict[str, Any]) -> bool:
    """A frame in a loaded library: py-spy names its module. A Python frame has none."""
    module = frame.get("module")
    filename = str(frame.get("filename") or "")
    return isinstance(module, str) and bool(module) and not filename.endswith(".py") and not module.endswith(".py")


def native_threads(process_dir: Path) -> list[list[dict[str, Any]]]:
    """Each thread's frames from ``py-spy --native`` (pyspy-native.json); none without that file."""
    try:
        data = read_json(process_dir / "pyspy-native.json", MAX_STACK_BYTES)
    except (FileNotFoundError, Unreadable):
        return []
    if not isinstance(data, list):
        return []
    out = []
    for t in data:
        frames = t.get("frames") if isinstance(t, dict) else None
        if isinstance(frames, list):
            out.append([f for f in frames if isinstance(f, dict)])
    return out


def native_gpu_wait(process_dir: Path) -> str | None:
    """The first native frame that waits on the GPU or in NCCL, if a thread of the program's shows one."""
    threads = native_threads(process_dir)
    names = [str(f.get("name") or "") for frames in threads for f in frames if is_native(f)]
    named = patterns.first(names, (patterns.COLLECTIVE_NATIVE, patterns.GPU_NATIVE))
    if named:  # a named wait says most
        return named
    for frames in threads:
        # NCCL's proxy threads and PyTorch's watchdog live in those libraries all the time;
        # a thread that also runs Python code and called down into them is what waits.
        if not any(not is_native(f) for f in frames):
            continue
        for f in frames:
            lib = str(f.get("short_filename") or "")
            if is_native(f) and lib.startswith(patterns.GPU_LIBRARIES):
                return f"{f.get('name')} ({lib})"
    return None
