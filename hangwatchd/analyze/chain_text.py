"""A chain of the wait-for graph said in one sentence, root first.

The sentence leads with the root (the deadlock's parties, the party that is
gone, the wait nobody can end, the party that sleeps or spins) and then says
how the hung party reaches it. What is inferred says so in ``rests_on``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .waitfor import CYCLE, ENDS_GONE, ENDS_IDLE, ENDS_LIVE, ENDS_NOBODY, Chain, Edge, Party


@dataclass(frozen=True)
class Told:
    kind: str  # the verdict's kind: deadlock, gone, nobody, sleeping, busy, gil-held, blocked-io, idle, unknown-wait
    sentence: str  # without a trailing period
    culprit: Party | None  # the party the chain ends at (or the first party of a cycle)
    where: str | None  # the culprit's frame
    sure: bool
    how: tuple[str, ...]  # the evidence of each edge followed


def _named(p: Party) -> str:
    return f"{p.label} ({p.where.replace(' (', ', ', 1)}" if p.where and p.where.endswith(")") else p.label


def _at(p: Party) -> str:
    return f"{p.label}, in {p.where}," if p.where else p.label


def _back(steps: tuple[tuple[Party, Edge], ...]) -> str:
    """How the first party reaches the last holder: '; thread MainThread waits for it in main (x.py:40),
    through thread coordinator (run_coordinator, x.py:34)'."""
    if not steps:
        return ""
    first, edge = steps[0]
    through = [p for p, _ in steps[1:]]
    text = f"; {first.label} waits for it" + (f" in {first.where}" if first.where else "")
    if through:
        text += ", through " + ", ".join(_named(p) for p in through[:4]) + (" and more" if len(through) > 4 else "")
    return text


def tell(chain: Chain) -> Told:
    how = tuple(dict.fromkeys(e.how for _, e in chain.steps if e.how))
    if chain.end == CYCLE:
        return _cycle(chain, how)
    if chain.end in (ENDS_GONE, ENDS_LIVE, ENDS_IDLE) and chain.root is not None:
        r = chain.root
        kind = ("gone" if chain.end == ENDS_GONE else "idle" if chain.end == ENDS_IDLE else _live_kind(r.doing or ""))
        lead = f"{_at(r)} {r.doing or 'runs'}" if chain.end != ENDS_GONE else f"{_named(r)} {r.doing or 'is gone'}"
        if chain.end == ENDS_IDLE and not chain.steps:
            lead = f"{_at(r)} {r.doing or 'waits for work'}: what would wake it cannot be read from outside the process"
        return Told(kind, lead + _back(chain.steps), r, r.where, chain.sure, how)
    last, edge = chain.steps[-1]
    if chain.end == ENDS_NOBODY:
        lead = f"{_at(last)} waits for {edge.what}: {edge.nobody}"
        return Told("nobody", lead + _back(chain.steps[:-1]), last, last.where, chain.sure, how)
    lead = f"{_at(last)} waits for {edge.what}; who could end it is not known: {edge.unknown or 'the evidence does not say'}"
    return Told("unknown-wait", lead + _back(chain.steps[:-1]), last, last.where, False, how)


def _live_kind(doing: str) -> str:
    if "GIL" in doing:
        return "gil-held"
    if doing.startswith("sleeps"):
        return "sleeping"
    if doing.startswith("is busy") or "spinning" in doing:
        return "busy"
    return "blocked-io"


def _cycle(chain: Chain, how: tuple[str, ...]) -> Told:
    parties = chain.cycle
    first = parties[0][0]
    if len(parties) == 1:
        p, e = parties[0]
        return Told("deadlock", f"{_at(p)} deadlocks on itself: it waits for {e.what} it already holds further up its own stack",
                    p, p.where, chain.sure, how)
    parts = [f"{_named(p)}, waiting for {e.what} held by {parties[(i + 1) % len(parties)][0].label}"
             for i, (p, e) in enumerate(parties)]
    text = "deadlock between " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])
    return Told("deadlock", text + _back(chain.steps[:chain.cycle_from]), first, first.where, chain.sure, how)
