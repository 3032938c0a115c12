"""Verdicts: what each captured process was doing, and which rank of a job diverged.

Works on any incident directory laid out as DESIGN.md says, also one put
together by hand: a subdirectory per process holding any of proc.json,
pyspy(-native).json, symbolized.json, nvml.json, flight-recorder.pkl.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import flight, lockstep
from .stacks import COLLECTIVE_WAITS, GPU_LIBRARIES, GPU_WAITS, is_user_frame, load_threads

LOCK_WAITS = ("acquire", "lock_PyThread", "_wait_for_tstate_lock", "take_gil", "pthread_mutex_lock")


@dataclass(frozen=True)
class RankVerdict:
    rank: int | None
    pid: int | None
    verdict: str  # gpu-exception, gpu-kernel-spinning, in-collective, waiting-on-gpu, lock-wait, idle-python, dead, unknown
    detail: str
    location: str | None  # "function (file:line)"
    collective: str | None = None
    last_collective: tuple[str, int] | None = None  # (pg, seq) last entered, from the flight recorder
    node: str | None = None  # the node it ran on (proc.json), for a job merged from many nodes


@dataclass(frozen=True)
class Culprit:
    rank: int | None
    pid: int | None
    reason: str
    location: str | None
    node: str | None = None


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
class Analysis:
    summary: str
    culprits: tuple[Culprit, ...]
    ranks: tuple[RankVerdict, ...]
    collectives: tuple[Collective, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _where(frame: dict[str, Any]) -> str:
    return f"{frame.get('name')} ({frame.get('filename')}:{frame.get('line')})"


def _user_location(threads: list[dict[str, Any]]) -> str | None:
    """The innermost frame of the user's own code, main thread first."""
    ordered = sorted(threads, key=lambda t: 0 if t.get("thread_name") in (None, "MainThread") else 1)
    for t in ordered:
        for f in t.get("frames") or []:
            if is_user_frame(f):
                return _where(f)
    return None


def process_dirs(incident: Path) -> list[Path]:
    wanted = ("proc.json", "pyspy.json", "pyspy-native.json", "symbolized.json", "flight-recorder.pkl", "nvml.json")
    return sorted(p for p in incident.iterdir() if p.is_dir() and any((p / w).exists() for w in wanted))


def judge(pdir: Path, known: dict[str, Any] | None = None) -> RankVerdict:
    """One process's verdict from whatever was captured of it (``known``: what incident.json says of it)."""
    proc = _json(pdir / "proc.json") or known or {}
    rank = proc.get("rank")
    pid = proc.get("pid") or (int(pdir.name) if pdir.name.isdigit() else None)
    sym = _json(pdir / "symbolized.json") or {}
    nvml = _json(pdir / "nvml.json") or {}
    threads = load_threads(pdir) or []
    record = flight.load(pdir / "flight-recorder.pkl")
    location = _user_location(threads)
    last = None
    pending = None
    if record:
        for pg, (enq, _started, done) in sorted(record.pg_status.items()):
            if enq >= 0:
                last = (pg, enq)
            if enq > done:
                e = record.entry(pg, enq)
                pending = e.name if e else f"collective #{enq}"
    busy = [d.get("utilization_percent") for d in nvml.get("devices", []) if d.get("index") in nvml.get("process_gpus", [])]
    gpu_busy = f", GPU {max(busy)}% busy" if busy and max(x or 0 for x in busy) else ""

    def verdict(kind: str, detail: str, loc: str | None = location, coll: str | None = None) -> RankVerdict:
        return RankVerdict(rank, pid, kind, detail, loc, coll, last, proc.get("node"))

    for e in sym.get("exceptions", []):
        frame = next((f for f in e.get("frames", []) if f.get("file")), None)
        loc = f"{frame['function']} ({frame['file']}:{frame['line']})" if frame else e.get("kernel")
        return verdict("gpu-exception", f"{e['type']} in {e.get('kernel')}", loc)
    kernels = [k["name"] for k in sym.get("kernels", [])]
    nccl = [k for k in kernels if k.startswith("ncclDevKernel") or "nccl" in k.lower()]
    if nccl:
        return verdict("in-collective", f"NCCL kernel {nccl[0]} running{gpu_busy}", location, pending or nccl[0])
    if kernels and sym.get("pcs"):
        p = sym["pcs"][0]
        frame = next((f for f in p.get("frames", []) if f.get("file")), None)
        loc = f"{frame['function']} ({frame['file']}:{frame['line']})" if frame else kernels[0]
        return verdict("gpu-kernel-spinning", f"kernel {kernels[0]} still running, {p.get('warps')} warps at {p.get('pc')}{gpu_busy}", loc)
    names = [str(f.get("name") or "") for t in threads for f in t.get("frames") or []]
    libs = [str(f.get("short_filename") or "") for t in threads for f in t.get("frames") or []]
    coll = next((n for n in names if any(w in n for w in COLLECTIVE_WAITS)), None)
    if pending or coll:
        return verdict("in-collective", f"waiting in {pending or coll}", location, pending or coll)
    gpu = next((n for n in names if any(w in n for w in GPU_WAITS)), None)
    if gpu or any(lib.startswith(GPU_LIBRARIES) for lib in libs):
        return verdict("waiting-on-gpu", f"host blocked in {gpu or 'the CUDA driver'}{gpu_busy}")
    lock = next((n for n in names if any(w in n for w in LOCK_WAITS)), None)
    if lock:
        return verdict("lock-wait", f"waiting for a lock ({lock})")
    if threads:
        return verdict("idle-python", "in Python, waiting on nothing known" if location else "in Python")
    gone = any("is gone" in str(s.get("error")) for s in (known or {}).get("steps", []))
    if gone or str(proc.get("state", "")).startswith(("Z", "X")):
        return verdict("dead", "the process had exited before it could be read")
    return verdict("unknown", "nothing was captured that says what it was doing")


def analyze(incident: Path) -> Analysis:
    meta = _json(incident / "incident.json") or {}
    known = {str(p.get("dir") or p.get("pid")): p for p in meta.get("processes", []) if isinstance(p, dict)}
    ranks = [judge(p, known.get(p.name)) for p in process_dirs(incident)]
    records = {}
    for p, v in zip(process_dirs(incident), ranks):
        rec = flight.load(p / "flight-recorder.pkl")
        if rec is not None and v.rank is not None:
            records[v.rank] = rec
    collectives = _collectives(records)
    culprits: list[Culprit] = []
    by_rank = {v.rank: v for v in ranks}
    summary = ""
    diverged = [c for c in collectives if c.ranks_missing]
    mismatched = [c for c in collectives if c.mismatch]
    if diverged:
        c = diverged[-1]
        for r in c.ranks_missing:
            v = by_rank.get(r)
            culprits.append(Culprit(r, v.pid if v else None, f"never entered {c.name} #{c.seq}", v.location if v else None))
        where = "; ".join(f"rank {x.rank} is at {x.location or 'an unknown place'}" for x in culprits)
        summary = (f"Rank{'s' if len(c.ranks_missing) > 1 else ''} {', '.join(map(str, c.ranks_missing))} never entered "
                   f"{c.name} #{c.seq} (process group {c.pg}) that rank{'s' if len(c.ranks_entered) > 1 else ''} "
                   f"{', '.join(map(str, c.ranks_entered))} wait{'' if len(c.ranks_entered) > 1 else 's'} in: {where}.")
    elif mismatched:
        c = mismatched[0]
        summary = f"Ranks disagree on {c.name} #{c.seq} (process group {c.pg}): {c.mismatch}."
        culprits = [Culprit(r, by_rank[r].pid if r in by_rank else None, c.mismatch or "", by_rank[r].location if r in by_rank else None)
                    for r in c.ranks_entered]
    elif lockstep.left_the_lockstep(process_dirs(incident))[0]:
        culprits, summary = lockstep.explain(process_dirs(incident), ranks, Culprit)
    else:
        odd = _odd_one_out(ranks)
        lost = [v for v in ranks if v.verdict in ("dead", "unknown")]
        waiting = [v for v in ranks if v.verdict == "in-collective"]
        if lost and waiting and len(lost) + len(waiting) == len(ranks):
            culprits = [Culprit(v.rank, v.pid, v.detail, None) for v in lost]
            summary = (f"Rank{'s' if len(waiting) > 1 else ''} {', '.join(str(v.rank) for v in waiting)} wait in "
                       f"{waiting[0].collective}; rank{'s' if len(lost) > 1 else ''} "
                       f"{', '.join(str(v.rank) for v in lost)}: {lost[0].detail}, so the one that did not join is there.")
        elif odd is not None:
            culprits.append(Culprit(odd.rank, odd.pid, f"{odd.verdict}: {odd.detail}", odd.location))
            summary = (f"Rank {odd.rank} is the odd one out: {odd.detail} at {odd.location or 'an unknown place'}, "
                       f"while the other ranks are {Counter(v.verdict for v in ranks if v is not odd).most_common(1)[0][0]}.")
        elif len(ranks) > 1 and len({v.verdict for v in ranks}) == 1 and ranks[0].verdict == "in-collective":
            summary = (f"Every rank here waits in the same collective ({ranks[0].collective}): the cause is outside "
                       "this node - a dead or slow peer on another node, or the network.")
        elif ranks:
            v = ranks[0]
            culprits.append(Culprit(v.rank, v.pid, f"{v.verdict}: {v.detail}", v.location))
            who = f"Rank {v.rank}" if v.rank is not None else f"pid {v.pid}"
            summary = f"{who}: {v.detail}" + (f" at {v.location}." if v.location else ".")
        else:
            summary = "Nothing was captured that can be analysed."
    nodes = {(v.rank, v.pid): v.node for v in ranks}
    culprits = [replace(c, node=nodes.get((c.rank, c.pid))) for c in culprits]
    return Analysis(summary, tuple(culprits), tuple(ranks), tuple(collectives))


def _odd_one_out(ranks: list[RankVerdict]) -> RankVerdict | None:
    if len(ranks) < 2:
        return None
    counts = Counter((v.verdict, v.collective) for v in ranks)
    if len(counts) != 2:
        return None
    (common, n), (rare, m) = counts.most_common(2)
    if m != 1 or n == 1 and len(ranks) > 2:
        return None
    if len(ranks) == 2:  # with two, the one not waiting in a collective is the odd one
        waiting = [v for v in ranks if v.verdict == "in-collective"]
        return next((v for v in ranks if v.verdict != "in-collective"), None) if len(waiting) == 1 else None
    return next(v for v in ranks if (v.verdict, v.collective) == rare)


def _collectives(records: dict[int, flight.FlightRecord]) -> list[Collective]:
    out: list[Collective] = []
    if not records:
        return out
    pgs = sorted({pg for r in records.values() for pg in r.pg_status})
    for pg in pgs:
        last = {rank: r.pg_status[pg][0] for rank, r in records.items() if pg in r.pg_status}
        top = max(last.values())
        seqs = sorted({e.seq for r in records.values() for e in r.entries if e.pg == pg and e.seq is not None})
        for seq in seqs:
            entered = tuple(sorted(rank for rank, n in last.items() if n >= seq))
            missing = tuple(sorted(rank for rank, n in last.items() if n < seq))
            entries = {rank: records[rank].entry(pg, seq) for rank in entered}
            present = {rank: e for rank, e in entries.items() if e is not None}
            if not present:
                continue
            first = next(iter(present.values()))
            mismatch = None
            names = {e.name for e in present.values()}
            sizes = {str(rank): e.input_sizes for rank, e in present.items()}
            if len(names) > 1:
                mismatch = "different collectives: " + ", ".join(f"rank {r} {e.name}" for r, e in present.items())
            elif len({json.dumps(e.input_sizes) for e in present.values()}) > 1:
                mismatch = "different sizes: " + ", ".join(f"rank {r} {e.input_sizes}" for r, e in present.items())
            elif len({json.dumps(e.input_dtypes) for e in present.values()}) > 1:
                mismatch = "different types: " + ", ".join(f"rank {r} {e.input_dtypes}" for r, e in present.items())
            if seq == top or missing or mismatch:
                out.append(Collective(pg, seq, first.name, entered, missing, sizes, mismatch))
    return out
