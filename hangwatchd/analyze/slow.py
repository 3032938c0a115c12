"""A slow job explained: the rank that holds the others back, its node, and why.

Reads the nodes' records of a job's pace (``slow.json`` beside a slow
incident's processes, or the records the nodes publish to the store): each
rank's stack samples by what its main thread was doing, its CPU, run delay
and children's CPU per step, and each GPU's NVML facts over the same window.
The rank that holds the job back is the one that waits least in collectives
(``detect.pace.slowest``); why is read from what sets it apart from the other
ranks, in this order:

- its GPU is throttled (which reason), or reports errors (ECC, PCIe, NVLink);
- its GPU is shared with a process that is not the job's;
- its input pipeline is starved (it waits for its DataLoader or worker
  processes; they are busy, or blocked);
- it waits for a CPU (run delay): the node's CPUs are oversubscribed;
- it is CPU-bound in its own code (the frame where it runs most);
- it waits for its own GPU work (more than the others');
- none of these: what its samples show, said plainly.

With no rank apart: every rank on one node waiting in collectives means the
network or another node holds the job back; ranks slower alike, none waiting,
is a job whose every rank does more work a step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..detect import pace
from ..model import GpuPace, JobPace, RankPace, pace_from_dict
from .jsonfile import Unreadable, read_json
from .records import Analysis, Culprit, RankVerdict

SLOW_FILE = "slow.json"
MAX_SLOW_BYTES = 16 << 20
SHARED_SM = 5  # SM % of a process that is not the job's on a rank's GPU that counts as sharing it
THROTTLED_CLOCK = 0.9  # an SM clock held below this share of its max, with a reason, is throttled
INPUT_GAP = 0.15  # waits for its input this much more often (a share of samples) than the others
QUIET = 0.02  # ... or for half of that where the others are (almost) never found waiting there
FEW = 3  # ... and it is, in this many of its samples at least
CPU_MORE = 1.15  # ... this many times the others' CPU a step
STARVED_GAP = 0.2  # it waits for a CPU this much more of the time it wants to run than the others do
APART = 0.05  # a frame sets a rank apart when it is in this much more of its samples than of the others'


@dataclass(frozen=True)
class Cause:
    kind: str  # gpu-throttled, gpu-errors, gpu-shared, input-starved, cpu-starved, cpu-bound, gpu-bound, unexplained
    text: str
    location: str | None = None


def read(incident: Path) -> list[JobPace] | None:
    """The records in ``incident/slow.json`` (this node's first); None when there is none.
    Raises Unreadable (or ValueError) for a file that is not one."""
    try:
        data = read_json(incident / SLOW_FILE, MAX_SLOW_BYTES)
    except FileNotFoundError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("records"), list) or not data["records"]:
        raise ValueError(f"{SLOW_FILE}: not an object with a list of records")
    return [pace_from_dict(r) for r in data["records"][:256]]


def analyze_dir(incident: Path) -> Analysis | None:
    """The slow verdict of an incident directory that holds a slow.json; None when it holds none."""
    try:
        records = read(incident)
    except (Unreadable, ValueError) as exc:
        return Analysis(f"The slow job's record cannot be read: {exc}.", (), (), (), unreadable=(f"{SLOW_FILE}: {exc}",))
    return judge(records) if records else None


def judge(records: Sequence[JobPace]) -> Analysis:
    """The verdict on a job from its nodes' records (the first is the node that asks)."""
    head = records[0]
    ranks = [r for rec in records for r in rec.ranks]
    found = pace.slowest(ranks)
    for rec in records:  # the rank a node named when the episode began, while its samples still say so
        if found is None and rec.state == "slow" and rec.named_node is not None:
            found = pace.confirmed(ranks, rec.named_rank, rec.named_node)
    gpus = {(rec.node, g.index): g for rec in records for g in rec.gpus}
    nodes = ", ".join(sorted({rec.node for rec in records}))
    lead = _lead(head)
    rests = [f"{len(ranks)} ranks on {nodes}: {sum(r.samples for r in ranks)} stack samples "
             f"over {head.window_s:.0f} s on {head.node}"]
    figures: dict[str, Any] = {"job": head.job, "step_s": head.step_s, "baseline_s": head.baseline_s,
                               "slower_by": round(head.slower_by, 4) if head.slower_by is not None else None,
                               "nodes": sorted({rec.node for rec in records}), "since": head.since}
    if found is not None:
        r = found.rank
        cause = why(r, [x for x in ranks if x is not r], gpus, head, {x.pid for x in ranks if x.node == r.node})
        figures.update(rank=r.rank, node=r.node, cause=cause.kind, wait_share=round(found.share, 4),
                       others_wait_share=round(found.others, 4))
        who = f"rank {r.rank} on {r.node}" if r.rank is not None else f"pid {r.pid} on {r.node}"
        summary = (f"{lead}: {who} holds it back (it waits in collectives {found.share:.0%} of the time, the other ranks "
                   f"{found.others:.0%}): {cause.text}.")
        told = cause.text.replace(f" at {cause.location}", "", 1) if cause.location else cause.text  # the location is said apart
        verdicts = tuple(_verdict(x, told, cause.location, verdict="slow-rank") if x is r else
                         _verdict(x, f"waits in collectives {_pct(x.wait_share)} of the time, for {who}", x.frame,
                                  verdict="waits-for-slow-rank") for x in ranks)
        return Analysis(summary, (Culprit(r.rank, r.pid, told, cause.location, r.node, r.gpu_index),), verdicts, (),
                        tuple(rests), pace=figures)
    here = [x for x in head.ranks if x.samples >= pace.MIN_SAMPLES]
    if pace.everyone_waits(head.ranks) and pace.contended(head.ranks, head.step_s):
        delays = sorted(x.delay_s for x in head.ranks if x.delay_s is not None)
        figures.update(cause="node-contended")
        summary = (f"{lead}: no rank holds the others back: every rank on {head.node} waits for a CPU ({_ms(delays[len(delays) // 2])} "
                   "a step, the median run delay) and so for each other in collectives: the node's CPUs are oversubscribed "
                   "(other processes, too many threads).")
        verdicts = tuple(_verdict(x, _doing(x) + f"; run delay {_ms(x.delay_s)} a step", x.frame, verdict="slow-alike")
                         for x in ranks)
        return Analysis(summary, (), verdicts, (), tuple(rests), pace=figures)
    if pace.everyone_waits(head.ranks):
        shares = sorted(x.wait_share or 0.0 for x in here)
        figures.update(cause="elsewhere")
        summary = (f"{lead}: every rank on {head.node} waits in collectives ({_span(shares)} of the time) and none of them "
                   f"holds the others back: the network or another node holds the job back")
        others = [rec for rec in records[1:] if rec.ranks]
        summary += (f" (the records of {', '.join(rec.node for rec in others)} name no rank either)." if others else
                    "; no other node's record of the job was read (a shared store names the slowest rank of the whole job).")
        verdicts = tuple(_verdict(x, f"waits in collectives {_pct(x.wait_share)} of the time", x.frame,
                                  verdict="waits-elsewhere") for x in ranks)
        return Analysis(summary, (), verdicts, (), tuple(rests), pace=figures)
    figures.update(cause="alike")
    summary = (f"{lead}: no rank holds the others back: every rank is slower alike and none waits in collectives "
               "much more than another (each does more work a step: a new phase of the job, or the whole node is slower).")
    verdicts = tuple(_verdict(x, _doing(x), x.frame, verdict="slow-alike") for x in ranks)
    return Analysis(summary, (), verdicts, (), tuple(rests), pace=figures)


def _lead(head: JobPace) -> str:
    if head.step_s is None or not head.baseline_s or head.slower_by is None:
        return f"Job {head.job} is slower than its baseline"
    return (f"Job {head.job} is {head.slower_by:.0%} slower than its baseline ({head.step_s:.3g} s a step against "
            f"{head.baseline_s:.3g} s)")


def why(r: RankPace, others: Sequence[RankPace], gpus: dict[tuple[str, int], GpuPace], head: JobPace,
        job_pids: set[int]) -> Cause:
    """What sets the rank that holds the job back apart from the others."""
    g = gpus.get((r.node, r.gpu_index)) if r.gpu_index is not None else None
    if g is not None:
        if g.throttle and (g.sm_clock_ratio is None or g.sm_clock_ratio < THROTTLED_CLOCK):
            facts = [f"SM clock at {g.sm_clock_ratio:.0%} of its max" if g.sm_clock_ratio is not None else None,
                     f"power at {g.power_ratio:.0%} of its limit" if g.power_ratio is not None else None,
                     f"{g.temperature_c:.0f} °C" if g.temperature_c is not None else None]
            return Cause("gpu-throttled", f"its GPU {g.index} is throttled ({', '.join(g.throttle)}): "
                         + ", ".join(f for f in facts if f), r.frame)
        errors = [f"{what} +{n}" for what, n in (("ECC errors", g.ecc_errors), ("PCIe replays", g.pcie_replays),
                                                 ("NVLink errors", g.nvlink_errors)) if n]
        if errors:
            return Cause("gpu-errors", f"its GPU {g.index} reports errors while it runs ({', '.join(errors)}): "
                         "a sick GPU or link", r.frame)
        strangers = [(pid, sm) for pid, sm in g.processes if pid not in job_pids and sm >= SHARED_SM]
        if strangers:
            listed = ", ".join(f"pid {pid} at {sm}% SM" for pid, sm in strangers[:4])
            return Cause("gpu-shared", f"its GPU {g.index} is shared with another process ({listed})", r.frame)
    step = head.step_s or head.baseline_s or 0.0
    input_share, their_input = r.share(r.input) or 0.0, _median(x.share(x.input) for x in others) or 0.0
    if _more_often(r, r.input, their_input):
        busy = r.kids_cpu_s is not None and step and r.kids_cpu_s >= 0.25 * step
        workers, are, they = (("its worker process", "is", "it") if r.kids == 1 else
                              (f"its {r.kids} worker processes" if r.kids else "its workers", "are", "they"))
        state = (f"{workers} {are} busy ({_ms(r.kids_cpu_s)} of CPU a step): {they} cannot produce batches fast enough"
                 if busy else f"{workers} {are} blocked, not computing ({_ms(r.kids_cpu_s)} of CPU a step): {they} wait"
                 f"{'s' if they == 'it' else ''} on I/O, a lock or a slow source" if r.kids_cpu_s is not None
                 else "its workers could not be read")
        return Cause("input-starved", f"its input pipeline is starved: it waits for its DataLoader or worker processes "
                     f"{input_share:.0%} of the time (the other ranks {their_input:.0%}); {state}", r.frame)
    # What a rank wanted of the CPU a step: the time it ran and the time it was ready to run but waited
    # for a CPU. On a busy node a rank that computes more gets little more CPU, and waits the more.
    mine_demand, their_demand = _demand(r), _median(_demand(x) for x in others)
    their_ratio = _median(x.delay_s / d for x in others if x.delay_s is not None and (d := _demand(x)))
    if r.delay_s is not None and mine_demand and step and r.delay_s >= 0.1 * step \
            and r.delay_s / mine_demand >= (their_ratio or 0.0) + STARVED_GAP:
        return Cause("cpu-starved", f"it waits for a CPU: run delay {_ms(r.delay_s)} a step, {r.delay_s / mine_demand:.0%} of the "
                     f"time it wants to run (the other ranks {_ms(_median(x.delay_s for x in others))}, "
                     f"{their_ratio or 0.0:.0%}): it gets less of the node's CPUs than the others", r.frame)
    their_cpu = _median(x.cpu_s for x in others)
    running, their_running = r.share(r.running) or 0.0, _median(x.share(x.running) for x in others) or 0.0
    # A rank whose samples are in GPU calls more often, and no more often in its own Python, waits for
    # its GPU: CPU time it spends more is a synchronise that spins (CUDA's default where CPUs are spare).
    if running < their_running + INPUT_GAP and (found := gpu_bound(r, others, g, gpus)) is not None:
        return found
    more_cpu = r.cpu_s is not None and their_cpu is not None and r.cpu_s >= CPU_MORE * their_cpu and r.cpu_s - their_cpu >= 0.05 * step
    more_demand = mine_demand is not None and their_demand is not None and mine_demand >= CPU_MORE * their_demand \
        and mine_demand - their_demand >= 0.05 * step
    if more_cpu or more_demand or (r.cpu_s is None and running >= their_running + INPUT_GAP):
        where = apart(r, others) or r.frame
        at = f" at {where}" if where else ""
        if more_cpu:
            cpu = f"{_ms(r.cpu_s)} of CPU a step against the other ranks' {_ms(their_cpu)}"
        elif more_demand:
            cpu = (f"it runs or waits to run {_ms(mine_demand)} a step against the other ranks' {_ms(their_demand)} (on a busy "
                   f"node: it got {_ms(r.cpu_s)} of CPU a step, they {_ms(their_cpu)})")
        else:
            cpu = f"it runs Python {running:.0%} of the time (the other ranks {their_running:.0%})"
        return Cause("cpu-bound", f"it is CPU-bound in its own code{at}: {cpu}", where)
    return gpu_bound(r, others, g, gpus) or Cause("unexplained", f"nothing in its stacks, CPU or GPU says why: {_doing(r)}", r.frame)


def gpu_bound(r: RankPace, others: Sequence[RankPace], g: GpuPace | None, gpus: dict[tuple[str, int], GpuPace]) -> Cause | None:
    """The rank waits for its own GPU work more often than the others do (its samples in a synchronise,
    a copy to the host, ``item``), else None."""
    gpu_share, their_gpu = r.share(r.gpu) or 0.0, _median(x.share(x.gpu) for x in others) or 0.0
    if not _more_often(r, r.gpu, their_gpu):
        return None
    sm = ""
    mine = dict(g.processes).get(r.pid) if g is not None else None
    if mine is not None:
        theirs = _median(dict(gpus[(x.node, x.gpu_index)].processes).get(x.pid) for x in others
                         if x.gpu_index is not None and (x.node, x.gpu_index) in gpus)
        sm = f"; SM {mine}%" + (f" against the others' {theirs:.0f}%" if theirs is not None else "")
    their_cpu = _median(x.cpu_s for x in others)
    spun = (f"; its CPU, {_ms(r.cpu_s)} a step against the others' {_ms(their_cpu)}, goes to waiting for the GPU "
            "(a synchronise that spins)" if r.cpu_s is not None and their_cpu and r.cpu_s >= CPU_MORE * their_cpu else "")
    return Cause("gpu-bound", f"it waits for its own GPU work {gpu_share:.0%} of the time (the other ranks "
                 f"{their_gpu:.0%}): it gives its GPU more to do a step{sm}{spun}", r.frame)


def _more_often(r: RankPace, mine: int, theirs: float) -> bool:
    """The rank is found waiting there (``mine`` of its samples) more often than the others (``theirs``,
    a share): by INPUT_GAP of its samples, or by half of it where the others are almost never found
    there (a wait a rank that keeps pace never shows: thirty samples of a window count four or five of
    it, where the full gap would ask for a chance draw of more)."""
    share = r.share(mine) or 0.0
    return share >= theirs + INPUT_GAP or (theirs <= QUIET and mine >= FEW and share >= theirs + INPUT_GAP / 2)


def apart(r: RankPace, others: Sequence[RankPace]) -> str | None:
    """The frame of its own code that sets this rank apart: a function it is found in more often than
    the other ranks are (by APART of its samples at least), of those the functions the other ranks
    were never seen in first (not the helper every rank calls, nor the loop they all run),
    and of those the outermost that comes near the most telling (the function only it runs, not a
    helper under it); None when none does. Functions are compared by name and file (a loop's line
    moves); the frame is named with its line."""
    sampled = [x for x in others if x.samples]
    if not r.samples or not r.frames:
        return None

    def by_function(frames: Sequence[tuple[str, int]], samples: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for frame, n in frames:
            out[_function(frame)] = min(1.0, out.get(_function(frame), 0.0) + n / samples)
        return out

    theirs = [by_function(x.frames, x.samples) for x in sampled]
    mine = by_function(r.frames, r.samples)
    shown: dict[str, str] = {}
    for frame, _n in r.frames:  # innermost first, as kept; of one function, its most sampled line
        shown.setdefault(_function(frame), frame)

    def usual(fn: str) -> float:
        return _median(t.get(fn, 0.0) for t in theirs) or 0.0

    def seen(fn: str) -> bool:  # by any other rank, once
        return any(t.get(fn) for t in theirs)

    scored = [(mine[fn] - usual(fn), seen(fn), fn) for fn in shown]  # innermost first
    candidates = [c for c in scored if c[0] >= APART]
    pool = [c for c in candidates if not c[1]] or candidates
    if not pool:
        return None
    # The outermost of those that come near the most telling: a function of the rank's own that only
    # it runs, rather than the helper it calls that the others were not caught in yet.
    best = max(c[0] for c in pool)
    return shown[[c[2] for c in pool if c[0] >= 0.8 * best][-1]]


def _function(frame: str) -> str:
    """"step (train.py:40)" -> "step (train.py)": a function, wherever in it."""
    name, _, where = frame.rpartition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if name else frame


def _demand(r: RankPace) -> float | None:
    return r.cpu_s + r.delay_s if r.cpu_s is not None and r.delay_s is not None else None


def _doing(r: RankPace) -> str:
    if not r.samples:
        return "not sampled"
    parts = [f"{what} {r.share(n):.0%}" for what, n in (("in collectives", r.collective), ("running", r.running),
                                                        ("waiting for input", r.input), ("waiting for its GPU", r.gpu)) if n]
    cpu = f"; {_ms(r.cpu_s)} of CPU a step" if r.cpu_s is not None else ""
    return (", ".join(parts) or "waiting elsewhere (sleeps, reads)") + f" of {r.samples} samples{cpu}"


def _verdict(r: RankPace, detail: str, location: str | None, verdict: str) -> RankVerdict:
    return RankVerdict(r.rank, r.pid, verdict=verdict, detail=detail, location=location, node=r.node)


def _median(values: Any) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{v:.0%}"


def _span(values: list[float]) -> str:
    return _pct(values[0]) if not values or values[0] == values[-1] else f"{_pct(values[0])} to {_pct(values[-1])}"


def _ms(v: float | None) -> str:
    return "?" if v is None else f"{v * 1000:.0f} ms" if v >= 0.0005 else f"{v * 1e6:.0f} us"
