"""Whom NCCL's RAS view blames: a rank missing or dead, else the rank behind in a communicator.

RAS counts collectives *launched*: ranks that all launched one that never
finishes read as equal, so only a difference names a rank; a missing or dead
process is the surest sign of all and leads.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ras import RasView


@dataclass(frozen=True)
class Blame:
    rank: int | None
    pid: int | None
    node: str | None
    gpu: int | None
    reason: str


def who(rank: int | None, pid: int | None, node: str | None = None, gpu: int | None = None) -> str:
    """'Rank 1 (pid 787 on node h, GPU 1)', or 'pid 787 on node h (GPU 1)' where the rank is not known."""
    where = f"pid {pid if pid is not None else '?'}" + (f" on node {node}" if node else "")
    if rank is None:
        return where + (f" (GPU {gpu})" if gpu is not None else "")
    return f"Rank {rank} ({where}" + (f", GPU {gpu})" if gpu is not None else ")")


def blame(view: RasView, waiting: str | None = None) -> tuple[str | None, tuple[Blame, ...]]:
    """(a sentence to lead the verdict with, the ranks to blame), or (None, ()) when RAS blames nobody.

    ``waiting``: what the captured ranks wait in, e.g. "rank 0 waits in all_reduce", for the sentence.
    """
    tail = f", while {waiting}" if waiting else ""
    gone = [r for r in view.missing if r.rank is not None or r.pid is not None]
    if gone:
        out = []
        for r in gone:
            how = ("dead: unreachable over the RAS network" if r.state == "dead"
                   else "missing: it does not answer NCCL's RAS")
            comm = f" (communicator {r.communicator[:8]})" if r.communicator else ""
            out.append(Blame(r.rank, r.pid, r.node, r.gpu, f"NCCL RAS: {how}{comm}"))
        first = gone[0]
        more = f" ({len(gone) - 1} more)" if len(gone) > 1 else ""
        sentence = (f"{who(first.rank, first.pid, first.node, first.gpu)} is {first.state}{more} according to "
                    f"NCCL's RAS{tail}: look at that rank first (its exit, its node's kernel log, OOM).")
        return sentence, tuple(out)
    for m in view.mismatches:
        top = max(m.counts, key=lambda c: c.count)
        behind = m.behind
        if not behind:
            continue
        blamed = tuple(Blame(c.rank, c.pid, c.node, c.gpu,
                             f"NCCL RAS: launched {c.count} {m.collective} where rank {top.rank} launched {top.count}")
                       for c in behind)
        c = behind[0]
        sentence = (f"{who(c.rank, c.pid, c.node, c.gpu)} is behind: it launched {c.count} {m.collective} "
                    f"where rank {top.rank} launched {top.count} (communicator {m.communicator[:8]}){tail}.")
        return sentence, blamed
    return None, ()
