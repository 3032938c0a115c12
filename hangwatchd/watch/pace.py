"""The daemon's running record of each job's pace, and the one place a slow episode changes.

A slow job is not a hung process: its ranks keep their own life (healthy,
suspect, hung, ...) in the ``Watchlist``, and a job that is slow and then
hangs gets its hang incident like any other. What the daemon learns of a job's
pace is kept here, one ``Pace`` per job (owner uid, name): each rank's beat
counts and counters at each look, its stack samples, the job's step time and
its baseline, and the episode (``state``): steady, slower (over the margin,
not yet for long enough), slow (an episode: one incident, here or on the node
of the rank that holds the job back). The state changes only through
``Paces.change``, on the loop thread, checked against ``TRANSITIONS``, as a
process's life is checked in ``watch/watched.py``.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from ..host.activity import Activity
from ..metrics import Metrics
from ..model import GpuPace, JobPace, ProcessId, RankPace, Registration

log = structlog.get_logger("hangwatchd.daemon")

JobKey = tuple[int, str]  # (owner uid, job name): a job, as everywhere

STEADY, SLOWER, SLOW = "steady", "slower", "slow"
# The legal moves of a job's pace. A job over its margin is slower; slower for long enough it is
# slow (an episode: one incident); back within its margin it is steady again, which ends an episode.
TRANSITIONS: Final[dict[str, frozenset[str]]] = {
    STEADY: frozenset({SLOWER}),
    SLOWER: frozenset({STEADY, SLOW}),
    SLOW: frozenset({STEADY}),
}

TICKS_KEEP = 512  # looks kept per rank (beat counts and counters), the newest
SAMPLES_KEEP = 512  # stack samples kept per rank, the newest
STEPS_KEEP = 512  # the job's step times kept, the newest
BASELINE_KEEP = 360  # steady steps the baseline is the median of (at one look every 5 s: 30 minutes)
GPU_LOOKS_KEEP = 64  # NVML looks kept while a job is slower or slow
FRAMES_KEEP = 12  # of a rank's own frames where it ran, the most sampled, kept in its record


@dataclass(frozen=True)
class Tick:
    """One look at a rank: its beat segment and its counters."""

    time: float  # monotonic
    beats: int
    last_ns: int  # CLOCK_MONOTONIC of its last beat
    activity: Activity


@dataclass(frozen=True)
class PaceSample:
    time: float  # monotonic
    kind: str  # detect.pace's COLLECTIVE, INPUT, GPU, RUNNING, WAITING
    chain: tuple[str, ...]  # the program's own frames, innermost first


@dataclass
class RankSeries:
    """What the daemon saw of one rank of the job: its looks and its samples (bounded)."""

    registration: Registration
    ticks: collections.deque[Tick] = field(default_factory=lambda: collections.deque(maxlen=TICKS_KEEP))
    samples: collections.deque[PaceSample] = field(default_factory=lambda: collections.deque(maxlen=SAMPLES_KEEP))
    gpu: int | None = None  # the GPU NVML lists it on


@dataclass
class Pace:
    """One job's pace on this node (owned by the loop; its state written by ``Paces.change`` alone)."""

    key: JobKey
    state: str = STEADY
    since: float | None = None  # monotonic: when it went over its margin
    since_wall: float | None = None
    baseline: float | None = None  # seconds a step, learned from its steady steps
    relearned: int = 0  # times the baseline was learned again after a new phase
    incident: str | None = None  # SLOW: the episode's incident on this node
    elsewhere: str | None = None  # SLOW: the node of the rank that holds it back, where that is not this one
    finding: JobPace | None = None  # SLOW: the record the episode was declared on
    named: tuple[int | None, str] | None = None  # SLOW: (rank, node) found holding the job back when it began
    ranks: dict[ProcessId, RankSeries] = field(default_factory=dict)
    steps: collections.deque[tuple[float, float]] = field(default_factory=lambda: collections.deque(maxlen=STEPS_KEEP))
    steady: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=BASELINE_KEEP))
    beats_seen: int = 0  # beats counted across its ranks while learning
    remote: dict[str, JobPace] = field(default_factory=dict)  # other nodes' newest records of the job (the store)
    gpus: collections.deque[tuple[float, dict[str, Any]]] = field(default_factory=lambda: collections.deque(maxlen=GPU_LOOKS_KEEP))
    paused: bool = False  # a rank of it is suspect, hung or captured: not judged, not sampled
    next_sample: float = 0.0
    turn: int = 0  # the rank whose turn it is to be sampled
    sampling: set[ProcessId] = field(default_factory=set)
    next_review: float = 0.0  # SLOW: when its ranks are next looked at for whether one still holds it back
    next_gpu_look: float = 0.0
    looking_at_gpus: bool = False
    series: Any = None  # its /metrics series (the loop's cache)

    @property
    def job(self) -> str:
        return self.key[1]

    @property
    def uid(self) -> int:
        return self.key[0]

    def window_start(self, now: float, window: float) -> float:
        """Where the figures start: the last ``window`` seconds, or when it went over its margin."""
        start = now - window
        return max(start, self.since) if self.since is not None and self.state != STEADY else start

    def record(self, node: str, now: float, wall: float, window: float, recent: bool = False) -> JobPace:
        """This node's record of the job over the window (``recent``: the last ``window`` seconds,
        wherever the episode began): what is published and judged."""
        start = now - window if recent else self.window_start(now, window)
        step = self.steps[-1][1] if self.steps else None
        ranks = tuple(rank_pace(s, node, start) for s in sorted(self.ranks.values(), key=_order))
        named = self.named if self.state == SLOW else None
        return JobPace(self.job, self.uid, node, wall, step, self.baseline, self.state, self.since_wall,
                       round(now - start, 3), ranks, gpu_paces(self.gpus, start, ranks),
                       named[0] if named else None, named[1] if named else None)


def _order(s: RankSeries) -> tuple[int, int]:
    r = s.registration
    return (r.rank if r.rank is not None else 1 << 30, r.process.pid)


def rank_pace(s: RankSeries, node: str, start: float) -> RankPace:
    """One rank's figures since ``start``: its samples by kind, its counters per step."""
    samples = [x for x in s.samples if x.time >= start]
    counts = collections.Counter(x.kind for x in samples)
    # Where its time goes: each of its own frames (the function it is in and those that called it), counted
    # once a sample, whatever the thread was doing there (a rank that computes is often caught waiting
    # for a CPU, which py-spy does not call running).
    frames = collections.Counter(f for x in samples for f in dict.fromkeys(x.chain))
    ticks = [t for t in s.ticks if t.time >= start]
    cpu = delay = kids_cpu = None
    kids = 0
    if len(ticks) >= 2 and ticks[-1].beats > ticks[0].beats:
        a, b = ticks[0].activity, ticks[-1].activity
        steps = ticks[-1].beats - ticks[0].beats
        cpu = _per_step(a.cpu_ns, b.cpu_ns, steps)
        delay = _per_step(a.wait_ns, b.wait_ns, steps)
        kids_cpu = _per_step(a.kids_cpu_ns, b.kids_cpu_ns, steps) if b.kids else None
        kids = b.kids
    r = s.registration
    innermost = collections.Counter(x.chain[0] for x in samples if x.kind == "running" and x.chain)
    # The most sampled, kept innermost first (a function before the functions that called it).
    depth: dict[str, int] = {}
    for x in samples:
        for i, f in enumerate(x.chain):
            depth[f] = min(depth.get(f, i), i)
    kept = sorted(frames.most_common(FRAMES_KEEP), key=lambda fn: (depth.get(fn[0], 0), -fn[1]))
    return RankPace(r.rank, r.process.pid, node, len(samples), counts["collective"], counts["input"], counts["gpu"],
                    counts["running"], innermost.most_common(1)[0][0] if innermost else None, cpu, delay, kids_cpu, kids,
                    s.gpu, tuple(kept))


def _per_step(a: int | None, b: int | None, steps: int) -> float | None:
    if a is None or b is None or b < a:
        return None  # a child that ended takes its CPU with it: no figure rather than a wrong one
    return round((b - a) / 1e9 / steps, 6)


def gpu_paces(looks: Iterable[tuple[float, dict[str, Any]]], start: float, ranks: Iterable[RankPace]) -> tuple[GpuPace, ...]:
    """Each GPU's facts over the NVML looks since ``start`` (the probe's JSON, capture/nvml_probe.py)."""
    seen = [d for t, d in looks if t >= start]
    by_index: dict[int, list[dict[str, Any]]] = {}
    for look in seen:
        for dev in look.get("devices") or []:
            if isinstance(dev, dict) and isinstance(dev.get("index"), int):
                by_index.setdefault(dev["index"], []).append(dev)
    out = []
    for index, devs in sorted(by_index.items()):
        ratios = [d["sm_clock_mhz"] / d["sm_clock_max_mhz"] for d in devs
                  if _num(d.get("sm_clock_mhz")) and _num(d.get("sm_clock_max_mhz"))]
        power = [d["power_watts"] / d["power_limit_watts"] for d in devs
                 if _num(d.get("power_watts")) is not None and _num(d.get("power_limit_watts"))]
        temps = [d["temperature_c"] for d in devs if _num(d.get("temperature_c")) is not None]
        reasons = sorted({r for d in devs for r in d.get("throttle_reasons") or [] if isinstance(r, str)})
        procs: dict[int, int] = {}
        for d in devs:
            util = d.get("process_utilization") or {}
            for smp in util.get("samples") or [] if isinstance(util, dict) else []:
                if isinstance(smp, dict) and isinstance(smp.get("pid"), int) and isinstance(smp.get("sm_percent"), int):
                    procs[smp["pid"]] = max(procs.get(smp["pid"], 0), smp["sm_percent"])
            for p in d.get("processes") or []:
                if isinstance(p, dict) and isinstance(p.get("pid"), int):
                    procs.setdefault(p["pid"], 0)
        out.append(GpuPace(index, devs[-1].get("uuid") if isinstance(devs[-1].get("uuid"), str) else None,
                           round(min(ratios), 3) if ratios else None, tuple(reasons),
                           round(max(power), 3) if power else None, max(temps) if temps else None,
                           _grew(devs, "ecc_errors"), _grew(devs, "pcie_replays"), _grew(devs, "nvlink_errors"),
                           tuple(sorted(procs.items()))))
    return tuple(out)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _grew(devs: list[dict[str, Any]], key: str) -> int | None:
    """How much a counter grew over the window (None where NVML never gave it)."""
    values = [d[key] for d in devs if isinstance(d.get(key), int) and not isinstance(d.get(key), bool)]
    if not values:
        return None
    return max(values) - values[0] if len(values) > 1 else 0


class NotLegal(Exception):
    """A move ``TRANSITIONS`` does not allow: a bug."""


class Paces(dict[JobKey, Pace]):
    """Every job's pace by (uid, name), and the one writer of each one's episode (``change``)."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self.metrics = metrics
        self.illegal = 0
        self._illegal = metrics.loop_errors.labels(**metrics.labels(where="pace_transition"))

    def change(self, p: Pace, state: str, *, why: str, **values: Any) -> bool:
        """Move ``p`` to ``state`` with the fields that go with it; a move the table does not allow
        is a bug: logged with its traceback, counted, and not made (False)."""
        if state not in TRANSITIONS[p.state]:
            self.illegal += 1
            self._illegal.inc()
            log.error("illegal_transition", job=p.job, uid=p.uid, old=p.state, new=state, why=why,
                      error=f"pace {p.state} -> {state} is not in TRANSITIONS (a bug)",
                      traceback="".join(traceback.format_stack(limit=12)[:-2]))
            return False
        unknown = values.keys() - _SETTABLE
        if unknown:
            raise TypeError(f"Paces.change: no such field of a job's pace: {', '.join(sorted(unknown))}")
        if state == STEADY:
            for name in ("since", "since_wall", "incident", "elsewhere", "finding", "named"):
                values.setdefault(name, None)
            values.setdefault("gpus", collections.deque(maxlen=GPU_LOOKS_KEEP))
        old = p.state
        for name, value in values.items():
            setattr(p, name, value)
        p.state = state
        log.info("job_pace_changed", job=p.job, uid=p.uid, old=old, new=state, why=why)
        return True


_SETTABLE: Final = frozenset({"since", "since_wall", "incident", "elsewhere", "finding", "named", "gpus", "baseline"})
