"""A chain of the wait-for graph said in one sentence, root first.

The sentence leads with the root (the deadlock's parties, the party that is
gone, the wait nobody can end, the party that is stuck doing something of its
own) and then says how the hung party reaches it:

    thread fetcher is stuck in fetch_config (app.py:28), reading a pipe whose other end only
    its own process holds, and no thread of it writes it: nobody will; thread MainThread waits
    for it in Thread.join (app.py:40), through thread coordinator (run_coordinator, app.py:34)
"""

from __future__ import annotations

from dataclasses import dataclass

from .waitfor import CYCLE, ENDS_GONE, ENDS_IDLE, ENDS_LIVE, ENDS_NOBODY, Chain, Edge, Party


@dataclass(frozen=True)
class Told:
    kind: str  # the verdict's kind: deadlock, gone, nobody, sleeping, busy, gil-held, blocked-io, idle, unknown-wait
    sentence: str  # without a trailing period
    culprit: Party | None  # the party the chain ends at (or the first party of a cycle)
    location: str | None  # the culprit's frame, its file's whole path
    sure: bool
    how: tuple[str, ...]  # the evidence of each edge followed


def _label(p: Party, apart: bool = False) -> str:
    """How a party is named; ``apart``: in a sentence about several processes, a thread says whose."""
    if apart and p.pid is not None and not p.label.startswith(("pid ", "child ")) and f"pid {p.pid}" not in p.label:
        return f"{p.label} of pid {p.pid}"
    return p.label


def _named(p: Party, apart: bool = False) -> str:
    """``thread coordinator (run_coordinator, app.py:34)``."""
    label = _label(p, apart)
    return f"{label} ({p.where.replace(' (', ', ', 1)}" if p.where and p.where.endswith(")") else label


def _waiter(p: Party, root: Party | None, edge: Edge) -> str:
    """The hung party as the sentence names it once the root has been said."""
    if root is not None and p.main and root.pid is not None and p.pid != root.pid \
            and p.label in ("the main thread", "thread MainThread"):
        return "the training loop" if edge.call == "_next_data" else f"its parent (pid {p.pid})"
    return p.label


def at(p: Party, e: Edge) -> str | None:
    """Where a party waits, as a person says it: the library call and the program's line that made it
    ("Queue.get (train.py:15)"), or its own frame ("main (app.py:40)") where the wait is its own."""
    if e.call and p.where and " (" in p.where:
        return f"{e.call} ({p.where.split(' (', 1)[1]}"
    return e.call or p.where


def _back(steps: tuple[tuple[Party, Edge], ...], root: Party | None) -> str:
    """How the hung party reaches the root: '; thread MainThread waits for it in Thread.join
    (app.py:40), through thread coordinator (run_coordinator, app.py:34)'."""
    if not steps:
        return ""
    first, edge = steps[0]
    through = [p for p, _ in steps[1:]]
    where = at(first, edge)
    waited = edge.what if not through and not edge.what.startswith(("its child", "a thread to end", "data ", "room ")) else "it"
    text = f"; {_waiter(first, root, edge)} waits for {waited}" + (f" in {where}" if where else "")
    if through:
        text += ", through " + ", ".join(_named(p) for p in through[:4]) + (" and more" if len(through) > 4 else "")
    return text


def _stuck(p: Party) -> str:
    """A live root: ``X is stuck in F (f.py:9), reading ...``; a GIL holder says whom it holds back."""
    doing = p.doing or "running"
    if doing.startswith("holding the GIL"):
        rest = doing.removeprefix("holding the GIL")
        return f"{p.label} holds the GIL{rest}" + (f", called from {p.where}" if p.where else "")
    return f"{p.label} is stuck in {p.where or 'a system call'}, {doing}"


def tell(chain: Chain) -> Told:
    how = tuple(dict.fromkeys(e.how for _, e in chain.steps if e.how))
    if chain.end == CYCLE:
        return _cycle(chain, how)
    r = chain.root
    if chain.end == ENDS_LIVE and r is not None:
        return Told(_live_kind(r.doing or ""), _stuck(r) + _back(chain.steps, r), r, r.location, chain.sure, how)
    if chain.end == ENDS_GONE and r is not None:
        why = chain.last.why if chain.last is not None else None
        return Told("gone", f"{_named(r)} {r.doing or 'is gone'}" + (f": {why}" if why else "") + _back(chain.steps, r),
                    r, r.location, chain.sure, how)
    if chain.end == ENDS_IDLE and r is not None:
        lead = f"{r.label} is {r.doing or 'waiting for work'}" + (f" in {r.where}" if r.where else "")
        if not chain.steps:
            lead += ": nothing the evidence holds says what would wake it"
        return Told("idle", lead + _back(chain.steps, r), r, r.location, False, how)
    last, edge = chain.steps[-1]
    where = f" in {last.where}" if last.where else ""
    call = f" ({edge.call})" if edge.call else ""
    if chain.end == ENDS_NOBODY:
        lead = f"{last.label} waits{where} for {edge.what}{call}: {edge.nobody}"
        return Told("nobody", lead + _back(chain.steps[:-1], last), last, last.location, chain.sure, how)
    lead = (f"{last.label} waits{where} for {edge.what}{call}; who could end it is not known: "
            f"{edge.unknown or 'the evidence does not say'}")
    return Told("unknown-wait", lead + _back(chain.steps[:-1], last), last, last.location, False, how)


def certainty(chain: Chain, told: Told) -> str:
    """How sure the chain's verdict is, and why: ``sure: ...`` when every link was read (the process's
    own answer, the kernel's tables, a frame that names the object), ``inferred: ...`` naming the
    first link guessed (by elimination, by a name), ``unknown: ...`` where the evidence stops."""
    how = ", ".join(told.how) or "its stacks"
    if told.kind == "unknown-wait" and chain.last is not None:
        return f"unknown: who could end the wait for {chain.last.what} ({chain.last.unknown or 'the evidence does not say'})"
    if chain.end == ENDS_IDLE:
        return "unknown: nothing the evidence holds says what would wake it"
    guessed = next(((p, e) for p, e in chain.steps if not e.sure), None)
    if guessed is not None:
        p, e = guessed
        holder = f", {_named(chain.root)}" if chain.root is not None and e.holder == chain.root.key else ""
        return f"inferred: that {p.label} waits for {e.what}{holder} is inferred ({e.how or 'by elimination'})"
    return f"sure: each link read from {how}"


def _live_kind(doing: str) -> str:
    if "GIL" in doing:
        return "gil-held"
    if doing.startswith("sleeping"):
        return "sleeping"
    if doing.startswith("busy") or "spinning" in doing:
        return "busy"
    return "blocked-io"


def _cycle(chain: Chain, how: tuple[str, ...]) -> Told:
    parties = chain.cycle
    first = parties[0][0]
    if len(parties) == 1:
        p, e = parties[0]
        return Told("deadlock", f"{p.label} deadlocks on itself in {p.where or 'its own code'}: it waits for {e.what}"
                    + _back(chain.steps[:chain.cycle_from], p), p, p.location, chain.sure, how)
    apart = len({p.pid for p, _ in parties}) > 1  # across processes: each party says whose it is
    parts = [f"{_named(p, apart)}, waiting for {e.what} ({_label(parties[(i + 1) % len(parties)][0], apart)})"
             for i, (p, e) in enumerate(parties)]
    text = "deadlock between " + (", ".join(parts[:-1]) + " and " + parts[-1])
    return Told("deadlock", text + _back(chain.steps[:chain.cycle_from], first), first, first.location, chain.sure, how)
