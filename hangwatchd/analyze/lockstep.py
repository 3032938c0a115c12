"""A rule only a job-wide view allows: the rank that left the lockstep.

Ranks of a data-parallel job move together; when the others are hung, a rank
that still makes progress (it beats, or its stack moves) is not waiting with
them: it went down another branch, and the others wait for it. On one node
this rank usually looks healthy, so only the job's merged incident shows it.
Evidence: ``progress.json`` of each process, written by the progress step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .jsonfile import read_json_or_none

C = TypeVar("C")


@dataclass(frozen=True)
class Progress:
    dir: str
    progressing: bool
    how: str  # "it beats", "its stack moves"


def read(pdir: Path) -> Progress | None:
    data = read_json_or_none(pdir / "progress.json")
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


def explain(pdirs: list[Path], ranks: Sequence[Any], culprit: Callable[..., C]) -> tuple[list[C], str]:
    """The culprits (built with ``culprit(rank, pid, reason, location)``) and the summary, where the rule applies.

    ``ranks`` are the verdicts of ``pdirs``, in the same order (each with rank, pid, node, location)."""
    moving, stuck = left_the_lockstep(pdirs)
    by_dir = dict(zip((p.name for p in pdirs), ranks))

    def who(name: str) -> str:
        v = by_dir[name]
        return (f"rank {v.rank}" if v.rank is not None else f"pid {v.pid}") + (f" on {v.node}" if v.node else "")

    found = [culprit(by_dir[p.dir].rank, by_dir[p.dir].pid, f"still making progress ({p.how}) while the others are hung",
                     by_dir[p.dir].location) for p in moving]
    where = "; ".join(f"{who(p.dir)} is at {by_dir[p.dir].location or 'an unknown place'}" for p in moving)
    summary = (f"{where[0].upper()}{where[1:]}: still making progress while {', '.join(who(p.dir) for p in stuck)} "
               f"{'is' if len(stuck) == 1 else 'are'} hung; it left the lockstep and the others wait for it.")
    return found, summary
