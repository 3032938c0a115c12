"""A rule only a job-wide view allows: the rank that left the lockstep.

Ranks of a data-parallel job move together; when the others are hung, a rank
that still makes progress (it beats, or its stack moves) is not waiting with
them: it went down another branch, and the others wait for it. On one node
this rank usually looks healthy, so only the job's merged incident shows it.
Evidence: ``progress.json`` of each process, written by the progress step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Progress:
    dir: str
    progressing: bool
    how: str  # "it beats", "its stack moves"


def read(pdir: Path) -> Progress | None:
    try:
        data = json.loads((pdir / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("progressing"), bool):
        return None
    how = f"it beat {data.get('beats')} times while captured" if data.get("beating") else "its stack moved while captured"
    return Progress(pdir.name, data["progressing"], how)


def left_the_lockstep(pdirs: list[Path]) -> tuple[list[Progress], list[Progress]]:
    """(ranks still progressing, ranks hung) where both exist and the progressing ones are not all;
    two empty lists where the rule does not apply."""
    seen = [p for p in (read(d) for d in pdirs) if p is not None]
    moving = [p for p in seen if p.progressing]
    stuck = [p for p in seen if not p.progressing]
    if not moving or not stuck:
        return [], []
    return moving, stuck
