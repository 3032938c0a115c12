"""What the analysis says of an incident: each rank's verdict, the culprits, the collectives.

The records the verdict builds and ``gone`` extends with the ranks that left;
kept apart so that both read them without importing each other."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Every kind of verdict a process can get, each documented with an example in docs/verdicts.md.
VERDICT_KINDS = (
    # the root of a wait-for chain (analyze/waitfor.py)
    "thread-deadlock", "deadlock", "gone", "nobody", "child-stuck", "blocked-io", "sleeping", "busy", "gil-held",
    "gil-held-in-c", "lock-wait", "unknown-wait", "waiting-on-children", "idle-python",
    # the GPU and the collectives
    "gpu-exception", "gpu-kernel-spinning", "stream-deadlock", "waiting-on-gpu", "in-collective",
    # what could not be read, and ranks that are not there
    "dead", "unknown", "exited", "not-here",
    # a slow job (analyze/slow.py): the rank that holds it back, the others, and a job with none apart
    "slow-rank", "waits-for-slow-rank", "waits-elsewhere", "slow-alike",
)


@dataclass(frozen=True)
class RankVerdict:
    rank: int | None
    pid: int | None
    verdict: str  # one of docs/verdicts.md: gpu-exception, child-stuck, thread-deadlock, stream-deadlock, ...
    detail: str
    location: str | None  # "function (file:line)"
    collective: str | None = None
    last_collective: tuple[str, int] | None = None  # (pg, seq) last entered, from the flight recorder
    node: str | None = None  # the node it ran on (proc.json), for a job merged from many nodes
    parent: int | None = None  # a child captured with its hung parent: the parent's pid
    role: str | None = None  # and what it is to the job ("DataLoader worker 1")
    certainty: str = ""  # "sure: ...", "inferred: ...", "unknown: ...": how sure the verdict is, and why


@dataclass(frozen=True)
class Culprit:
    rank: int | None
    pid: int | None
    reason: str
    location: str | None
    node: str | None = None
    gpu: int | None = None


@dataclass(frozen=True)
class Collective:
    pg: str
    seq: int
    name: str
    ranks_entered: tuple[int, ...]
    ranks_missing: tuple[int, ...]
    sizes: dict[str, Any] = field(default_factory=dict)
    mismatch: str | None = None


@dataclass(frozen=True)
class Blame:
    """A GPU fault an incident's verdict rests on, recorded against the GPU it happened on (and its
    node) in the ledger of suspects (``incidents/ledger.py``). ``kind``: "gpu" when the GPU (or its
    node) is at fault and explains the hang; "application" when it was the program's own fault
    (NVIDIA's catalogue: restart the application) on that GPU: the job's, and the GPU's only if
    other jobs meet the same there."""

    kind: str
    why: str  # the sentence of the verdict that says so
    pid: int | None
    rank: int | None
    node: str | None
    gpu: int | None  # NVML's index on that node
    uuid: str | None
    serial: str | None
    pci: str | None
    xid: int | None  # None: the GPU was lost (stopped answering)
    time: float | None  # when the GPU reported it


@dataclass(frozen=True)
class Analysis:
    summary: str
    culprits: tuple[Culprit, ...]
    ranks: tuple[RankVerdict, ...]
    collectives: tuple[Collective, ...]
    rests_on: tuple[str, ...] = ()  # the evidence there was: "pid 12: native stacks, GPU dump", ...
    unreadable: tuple[str, ...] = ()  # each piece of evidence that could not be read, and why
    children: tuple[RankVerdict, ...] = ()  # the hung processes' children (workers, subprocesses), each judged
    pace: dict[str, Any] | None = None  # a slow job's figures: step, baseline, the rank, its node, the cause (analyze/slow.py)
    blame: tuple[Blame, ...] = ()  # the GPU faults the verdict rests on, each with its GPU and node

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
