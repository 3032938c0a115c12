"""A job's pace: what a rank's main thread does at a stack sample, how fast the job steps, and
which rank holds the others back.

In a synchronous job every rank's step time is the same: the ranks wait for
each other in a collective every step, so the step times alone cannot say who
is slow. The rank that holds the others back is the one that waits least: a
low-rate stack sample of each rank (``py-spy dump --nonblocking``: the rank is
not paused) says whether its main thread waits in a collective or a barrier
(for the others), for its input pipeline, for its GPU, or runs. Step times come
from the beats a rank already makes (the beat segment's count and the time of
its last beat): nothing is added to the workload.

Everything here is arithmetic on values the loop hands in; what to do about it
is ``detect/pace_machine.py``'s.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..model import RankPace
from . import patterns

# What a rank's main thread does at a sample.
COLLECTIVE = "collective"  # waits in a collective or a barrier: for the other ranks
INPUT = "input"  # waits for its input pipeline: a DataLoader's batch, a multiprocessing queue or pool
GPU = "gpu"  # waits for its GPU (a synchronize, an item(), a copy back)
RUNNING = "running"  # on a CPU, running Python (its own code or a library's)
WAITING = "waiting"  # anything else: a sleep, a read, a lock

_BARRIER_FILES = ("threading.py", "multiprocessing/synchronize.py")  # threading.Barrier.wait, multiprocessing's Barrier


@dataclass(frozen=True)
class MainThread:
    """What the program's main thread was doing at one sample."""

    kind: str  # COLLECTIVE, INPUT, GPU, RUNNING or WAITING
    chain: tuple[str, ...]  # the program's own frames, innermost first (at most CHAIN), each "function (file:line)"

    @property
    def at(self) -> str | None:
        """The program's own innermost frame."""
        return self.chain[0] if self.chain else None


CHAIN = 8  # of the program's own frames kept per sample


def main_thread(threads: Sequence[dict[str, Any]]) -> MainThread | None:
    """What the main thread of a plain py-spy dump does (Python frames only, innermost first);
    None when the dump has no thread of the program's."""
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), None)
    if main is None:
        main = next((t for t in threads if not patterns.HELPER_THREAD.search(str(t.get("thread_name") or ""))), None)
    if main is None:
        return None
    frames = [f for f in main.get("frames") or [] if isinstance(f, dict)]
    names = [str(f.get("name") or "") for f in frames]
    at = tuple(f"{f.get('name')} ({f.get('short_filename') or f.get('filename')}:{f.get('line')})"
               for f in frames if patterns.is_user_frame(f))[:CHAIN]
    if patterns.first(names, patterns.COLLECTIVE) or any(
            str(f.get("name") or "").endswith("Barrier.wait") and str(f.get("filename") or "").endswith(_BARRIER_FILES)
            for f in frames):
        return MainThread(COLLECTIVE, at)
    if any(any(m in str(f.get("filename") or "") for m in patterns.CHILD_WAIT_FILES)
           and patterns.CHILD_WAIT.search(str(f.get("name") or "")) for f in frames):
        return MainThread(INPUT, at)
    if patterns.first(names, patterns.GPU):
        return MainThread(GPU, at)
    if main.get("active") is True:
        return MainThread(RUNNING, at)
    return MainThread(WAITING, at)


def median(values: Iterable[float]) -> float | None:
    got = list(values)
    return statistics.median(got) if got else None


def rank_step(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Seconds a step of one rank between two reads of its beat segment, each (count, last_ns):
    the time between the last beats read, over the beats made in between; None when it made none."""
    beats = after[0] - before[0]
    if beats <= 0 or after[1] <= before[1]:
        return None
    return (after[1] - before[1]) / 1e9 / beats


# -- who holds the others back ---------------------------------------------------------------------

MIN_SAMPLES = 8  # a rank's samples in the window before its wait share is taken at its word
MIN_GAP = 0.08  # the straggler waits at least this much less (as a share of samples) than the others
MIN_Z = 3.0  # ... and the difference is this many standard errors: chance alone rarely makes it
WAIT_ALL = 0.25  # every rank waits at least this share: the cause is outside the ranks here


@dataclass(frozen=True)
class Slowest:
    """The rank that waits least in collectives, and how clearly."""

    rank: RankPace
    share: float  # its wait share
    others: float  # the other ranks' share, pooled
    z: float  # the difference in standard errors of two proportions


def least(ranks: Sequence[RankPace], min_samples: int = MIN_SAMPLES) -> Slowest | None:
    """The rank whose main thread waits least in collectives against the others pooled, however
    clearly; None with fewer than two ranks sampled ``min_samples`` times."""
    read = [r for r in ranks if r.samples >= min_samples]
    if len(read) < 2:
        return None
    best = min(read, key=lambda r: (r.collective / r.samples, -r.samples))
    rest = [r for r in read if r is not best]
    n1, n2 = best.samples, sum(r.samples for r in rest)
    p1, p2 = best.collective / n1, sum(r.collective for r in rest) / n2
    pooled = (best.collective + sum(r.collective for r in rest)) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return Slowest(best, p1, p2, (p2 - p1) / se if se > 0 else 0.0)


def slowest(ranks: Sequence[RankPace], min_samples: int = MIN_SAMPLES) -> Slowest | None:
    """The rank that holds the others back: the one whose main thread waits least in collectives,
    when it waits clearly less than the others pooled (a gap of MIN_GAP and MIN_Z standard
    errors); None when no rank stands out (or too few were sampled enough)."""
    found = least(ranks, min_samples)
    if found is None or found.others - found.share < MIN_GAP or found.z < MIN_Z:
        return None
    return found


CONFIRM_Z = 2.0  # a rank a node named when its episode began is still the one while it stands this far apart


def confirmed(ranks: Sequence[RankPace], rank: int | None, node: str, min_samples: int = MIN_SAMPLES) -> Slowest | None:
    """The rank a node named when the job's episode began (at MIN_Z), while it still waits least and
    stands apart at CONFIRM_Z: naming it again needs less than naming it first did."""
    found = least(ranks, min_samples)
    if found is None or (found.rank.rank, found.rank.node) != (rank, node):
        return None
    return found if found.z >= CONFIRM_Z and found.others - found.share >= MIN_GAP / 2 else None


ALIKE_Z = 1.0  # the rank that waits least is within this many standard errors of the others: chance alone


def alike(ranks: Sequence[RankPace], min_samples: int = 4 * MIN_SAMPLES) -> bool:
    """Every rank sampled well (``min_samples`` each), and the one that waits least no further from
    the others than chance makes it: no rank holds the others back (a job slower alike everywhere)."""
    if any(r.samples < min_samples for r in ranks):
        return False
    found = least(ranks, min_samples)
    return found is not None and (found.z < ALIKE_Z or found.others - found.share < MIN_GAP / 2)


def everyone_waits(ranks: Sequence[RankPace], min_samples: int = MIN_SAMPLES) -> bool:
    """Every rank sampled enough waits in collectives at least WAIT_ALL of the time: none of them is
    the one the job waits for."""
    read = [r for r in ranks if r.samples >= min_samples]
    return bool(read) and all(r.collective / r.samples >= WAIT_ALL for r in read)


CONTENDED = 0.05  # ranks that wait for a CPU this share of a step (their median): the node's CPUs are oversubscribed


def contended(ranks: Sequence[RankPace], step: float | None) -> bool:
    """The ranks wait for a CPU (their run delay a step, the median) a noticeable share of a step:
    on an oversubscribed node every rank waits longer in a collective too (its peers are not
    running), so waiting everywhere there does not point at the network or another node."""
    delays = [r.delay_s for r in ranks if r.delay_s is not None]
    return bool(step) and bool(delays) and statistics.median(delays) >= CONTENDED * (step or 0.0)
