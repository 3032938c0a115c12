"""The wait-for graph: who waits for whom, and the root of the chain.

A hang is a chain: a thread waits for a lock held by a thread that waits for a
child process that reads a pipe nobody writes. Every thread, process and rank
of an incident is a ``Party``; each ``Edge`` says what one party waits for,
which party (if any) can end the wait, and how that is known. Following the
edges from the party that hung ends in one of five ways, and the verdict
leads with that end, never with the frame that waits:

- a **cycle**: a deadlock; every party in it is named with its frame;
- a party that is **gone**: the thread that exited, the worker that was
  killed (and by what), the rank that left;
- **nobody**: an edge with no party that could end it (a pipe no process can
  write, an event no live thread will set);
- a **live root**: a party that waits for nothing the evidence knows of, and
  is doing something itself (sleeps, spins, holds the GIL in a blocking call,
  reads from a peer that never sends);
- an **unknown** edge: the evidence cannot say who could end the wait; the
  verdict says which edge and why, rather than blaming the waiter.

This module holds the graph and its reading; ``process_graph`` builds it from
an incident's evidence. It reads no files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What a party is doing when nothing it waits for is known: the ends a chain can have.
WAITS = "waits"  # waits for something (its edges say what)
LIVE = "live"  # does something itself: sleeps, spins, runs, blocks in a call nobody else can end
GONE = "gone"  # no longer there: exited, killed, never started
IDLE = "idle"  # waits for work that is not there: a server with nothing to do


@dataclass(frozen=True)
class Party:
    key: str  # unique in the graph: "12/t34" (a thread), "12" (a process), "rank 1"
    label: str  # how a person names it: "thread fetcher", "worker 2 (pid 17537)", "rank 1"
    state: str = WAITS
    where: str | None = None  # "fetch_config (join_chain_pipe.py:28)": its innermost frame of the program's own
    doing: str | None = None  # for a live party, what it does: "reading a pipe", "sleeping"; for a gone one, how it went
    culprit: str | None = None  # the function to blame when this party is the root (the code, not the wait)
    location: str | None = None  # ``where`` with the file's whole path (the verdict's location)
    pid: int | None = None  # the process it is (or is a thread of)
    main: bool = False  # the process's main thread (or the process itself)


@dataclass(frozen=True)
class Edge:
    waiter: str  # a party's key
    what: str  # what it waits for, as a person says it: "lock journal_lock", "the GIL", "thread coordinator to end"
    holder: str | None = None  # the party that can end the wait; None: nobody, or not known (``nobody`` says which)
    nobody: str | None = None  # with no holder: why nobody can end it ("no live thread holds it"); None: unknown
    unknown: str | None = None  # with no holder and no ``nobody``: why it cannot be known
    how: str = ""  # the evidence: "native frames", "introspection", "pipe ends in /proc/*/fd", ...
    sure: bool = True  # False where it is inferred (by elimination, by name)
    call: str | None = None  # the library call the waiter waits in, as a person says it: "Queue.get", "Thread.join"
    why: str | None = None  # for an edge to a party that is gone: what that party had to do with the wait


@dataclass
class Graph:
    parties: dict[str, Party] = field(default_factory=dict)
    edges: dict[str, list[Edge]] = field(default_factory=dict)  # waiter key -> its edges

    def add(self, party: Party) -> Party:
        self.parties.setdefault(party.key, party)
        return self.parties[party.key]

    def wait(self, edge: Edge) -> None:
        if edge not in self.edges.setdefault(edge.waiter, []):
            self.edges[edge.waiter].append(edge)

    def out(self, key: str) -> list[Edge]:
        return self.edges.get(key, [])


# How a chain ends, best explained first: a cycle names every party; a party that is gone or
# nobody able to end the wait is a cause by itself; a live root is a cause where it does
# something; an unknown edge says only where the evidence stops.
CYCLE, ENDS_GONE, ENDS_NOBODY, ENDS_LIVE, ENDS_IDLE, ENDS_UNKNOWN = "cycle", "gone", "nobody", "live", "idle", "unknown"
_RANK = {CYCLE: 6, ENDS_GONE: 5, ENDS_NOBODY: 4, ENDS_LIVE: 3, ENDS_IDLE: 2, ENDS_UNKNOWN: 1}
MAX_DEPTH = 32  # parties followed from one start (a chain is rarely longer than a few)
MAX_PATHS = 256  # branches explored from one start


@dataclass(frozen=True)
class Chain:
    """One path from a waiting party to its root."""

    end: str  # CYCLE, ENDS_GONE, ENDS_NOBODY, ENDS_LIVE, ENDS_IDLE or ENDS_UNKNOWN
    steps: tuple[tuple[Party, Edge], ...]  # each party on the way and the edge it waits on, from the start
    root: Party | None  # the party the chain ends at (the last holder); None where it ends in an edge
    cycle_from: int = 0  # CYCLE: the index in ``steps`` where the cycle starts

    @property
    def sure(self) -> bool:
        return all(e.sure for _, e in self.steps)

    @property
    def last(self) -> Edge | None:
        return self.steps[-1][1] if self.steps else None

    @property
    def cycle(self) -> tuple[tuple[Party, Edge], ...]:
        return self.steps[self.cycle_from:] if self.end == CYCLE else ()


def chains(graph: Graph, start: str) -> list[Chain]:
    """Every chain from ``start`` to a root (bounded), best explained first."""
    out: list[Chain] = []
    stack: list[tuple[str, tuple[tuple[Party, Edge], ...]]] = [(start, ())]
    while stack and len(out) < MAX_PATHS:
        key, path = stack.pop()
        party = graph.parties.get(key)
        if party is None:
            continue
        seen = [p.key for p, _ in path]
        if key in seen:
            out.append(Chain(CYCLE, path, party, seen.index(key)))
            continue
        edges = graph.out(key)
        if party.state != WAITS or not edges or len(path) >= MAX_DEPTH:
            end = {GONE: ENDS_GONE, IDLE: ENDS_IDLE}.get(party.state, ENDS_LIVE if party.state == LIVE else ENDS_UNKNOWN)
            if path or party.state != WAITS:
                out.append(Chain(end, path, party))
            continue
        for edge in reversed(edges):
            step = (*path, (party, edge))
            if edge.holder is None:
                out.append(Chain(ENDS_NOBODY if edge.nobody else ENDS_UNKNOWN, step, None))
            else:
                stack.append((edge.holder, step))
    # One chain per root: the longest way to it (the whole chain is the story), then best first.
    # A cycle through inferred edges only ranks below every other end: threads that each might
    # hold what another waits for are a deadlock only when nothing else explains the wait.
    longest: dict[tuple[str, str | None, int], Chain] = {}
    for c in out:
        k = (c.end, c.root.key if c.root else c.steps[-1][0].key if c.steps else None, c.cycle_from if c.end == CYCLE else 0)
        if k not in longest or len(c.steps) > len(longest[k].steps):
            longest[k] = c
    return sorted(longest.values(), key=_order)


def _order(c: Chain) -> tuple[int, bool, int]:
    rank = _RANK[c.end] if c.end != CYCLE or c.sure else _RANK[ENDS_IDLE] + 0.5
    return (-rank, not c.sure, len(c.steps))  # type: ignore[return-value]


def root(graph: Graph, start: str) -> Chain | None:
    """The best explained chain from ``start``; None when it waits for nothing at all."""
    found = chains(graph, start)
    return found[0] if found else None
