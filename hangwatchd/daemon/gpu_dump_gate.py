"""The GPU-dump gate: may this capture take a CUDA coredump, which ends the process?

Policy ``always`` and ``never`` say so plainly. ``confirmed`` (the default)
wants two signals that agree (the heartbeat and the stack), or one thread the
capture found waiting on the GPU or a collective: a dump is the one step that
cannot be taken back.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from ..analyze.stacks import gpu_wait

log = structlog.get_logger("hangwatchd.daemon")


def gpu_dump_veto(policy: str, outdir: Path, signals: tuple[str, ...] = ()) -> str | None:
    """Why not to take a GPU dump of the process captured into ``outdir``; None means take it."""
    if policy == "always":
        return None
    if policy == "never":
        return "gpu_dump = never"
    if {"heartbeat", "stack"} <= set(signals):
        log.info("gpu_dump_confirmed", dir=str(outdir), signals=list(signals))
        return None
    waiting = gpu_wait(outdir)
    if waiting:
        log.info("gpu_dump_confirmed", dir=str(outdir), frame=waiting)
        return None
    return ("not confirmed: only one signal, and no thread waits on the GPU or a collective "
            "(gpu_dump = confirmed)")
