"""Verdicts: what each captured process was doing, and which rank of a job diverged.

Works on any incident directory laid out as docs/design.md says, also one put
together by hand: a subdirectory per process holding any of proc.json,
pyspy(-native).json, symbolized.json, nvml.json, flight-recorder.pkl.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..detect import patterns
from . import (
    evidence,
    flight,
    gpu_events,
    lockstep,
    process_tree,
    ras,
    ras_blame,
    stream_deadlock,
)
from . import threads as th
from .gone import account
from .records import Analysis, Collective, Culprit, RankVerdict
from .stacks import is_user_frame, library_frames


def _where(frame: dict[str, Any]) -> str:
    return f"{frame.get('name')} ({frame.get('filename')}:{frame.get('line')})"


def _user_location(threads: list[dict[str, Any]]) -> str | None:
    """The innermost frame of the user's own code, main thread first, helper threads never."""
    for t in th.ordered(threads):
        for f in t.get("frames") or []:
            if is_user_frame(f):
                return _where(f)
    return None


def process_dirs(incident: Path) -> list[Path]:
    wanted = ("proc.json", "pyspy.json", "pyspy-native.json", "symbolized.json", "flight-recorder.pkl", "nvml.json",
              "nccl-ras.txt", "nccl-ras.json")
    try:
        subdirs = [p for p in incident.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
    return sorted(p for p in subdirs if any((p / w).exists() for w in wanted))


def judge(pdir: Path, known: dict[str, Any] | None = None) -> RankVerdict:
    """One process's verdict from whatever was captured of it (``known``: what incident.json says of it)."""
    return judge_evidence(pdir, evidence.read(pdir, known), known)


def judge_evidence(pdir: Path, ev: evidence.Evidence, known: dict[str, Any] | None = None) -> RankVerdict:
    proc = ev.proc
    rank = evidence.as_int(proc.get("rank"))
    pid = evidence.as_int(proc.get("pid")) or (int(pdir.name) if pdir.name.isdigit() else None)
    sym, nvml, threads, record = ev.symbolized, ev.nvml, list(ev.threads), ev.record
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
    gpus = stream_deadlock.process_gpus(nvml)
    gpu_busy = stream_deadlock.busy_text(nvml, gpus, pid)
    wchans = {t["tid"]: str(t.get("wchan") or "") for t in evidence.dicts(proc.get("threads")) if evidence.as_int(t.get("tid"))}

    def verdict(kind: str, detail: str, loc: str | None = location, coll: str | None = None) -> RankVerdict:
        return RankVerdict(rank, pid, kind, detail, loc, coll, last, proc.get("node"))

    def full(f: dict[str, Any] | None) -> str | None:
        return _where(f) if f else None

    for exc in evidence.dicts(sym.get("exceptions")):
        frame = next((f for f in evidence.dicts(exc.get("frames")) if f.get("file")), None)
        loc = f"{frame.get('function')} ({frame.get('file')}:{frame.get('line')})" if frame else exc.get("kernel")
        return verdict("gpu-exception", f"{exc.get('type', 'an exception')} in {exc.get('kernel')}", loc)
    kernels = [str(k["name"]) for k in stream_deadlock.kernels_on(sym, gpus)]
    nccl = [k for k in kernels if "nccl" in k.lower()]
    if nccl:
        return verdict("in-collective", f"NCCL kernel {nccl[0]} running{gpu_busy}", location, pending or nccl[0])
    pcs = [p for p in evidence.dicts(sym.get("pcs")) if not gpus or p.get("device") in gpus]
    if kernels and pcs:
        p = pcs[0]
        frame = next((f for f in evidence.dicts(p.get("frames")) if f.get("file")), None)
        loc = f"{frame.get('function')} ({frame.get('file')}:{frame.get('line')})" if frame else kernels[0]
        return verdict("gpu-kernel-spinning", f"kernel {kernels[0]} still running, {p.get('warps')} warps at {p.get('pc')}{gpu_busy}", loc)
    names = [str(f.get("name") or "") for t in threads for f in t.get("frames") or []]
    coll = patterns.first(names, patterns.COLLECTIVE)
    if pending or coll:
        return verdict("in-collective", f"waiting in {pending or coll}", location, pending or coll)
    gpu = patterns.first(names, patterns.GPU)
    in_driver = bool(library_frames(threads))
    if gpu or in_driver:
        call = stream_deadlock.driver_call(tuple(threads)) or gpu or "the CUDA driver"
        idle = stream_deadlock.idle_gpu(sym, nvml, pid) if in_driver or ev.native else None
        if idle:
            return verdict("stream-deadlock", f"host blocked in {call} while {idle}: it waits for GPU work that never "
                                              f"runs; {stream_deadlock.WHAT_TO_LOOK_AT}")
        return verdict("waiting-on-gpu", f"host blocked in {call}{gpu_busy}")
    spin = th.gil_spin(threads)
    if spin:
        others = len(threads) - 1
        name = spin.thread.get("thread_name") or spin.thread.get("os_thread_id")
        return verdict("gil-held-in-c", f"thread {name} holds the GIL while spinning in C in {th.short(spin.native)}"
                                        + (f", called from {th.short(spin.caller)}" if spin.caller else "")
                                        + (f"; the other {others} threads cannot run Python" if others > 1
                                           else "; the other thread cannot run Python" if others else ""),
                       full(spin.caller) or location)
    locked = th.deadlock(threads, wchans)
    if locked:
        return verdict("thread-deadlock", th.deadlock_text(locked), full(locked[0][1]))
    mine = th.ordered(threads, pid)  # main thread first; helper threads wait in locks all the time
    main = th.main_thread(threads, pid)
    waits = th.child_wait(main) if main else None
    if waits:
        return verdict("waiting-on-children", f"waiting for its child processes in {th.call_name(waits)}")
    lock = patterns.first((str(f.get("name") or "") for t in mine for f in t.get("frames") or []), (patterns.LOCK,))
    if lock:
        return verdict("lock-wait", f"waiting for a lock, an event or a join ({lock})")
    if threads:
        return verdict("idle-python", "in Python, waiting on nothing known" if location else "in Python")
    steps = (known or {}).get("steps") if isinstance((known or {}).get("steps"), list) else []
    gone = any("is gone" in str(s.get("error")) for s in evidence.dicts(steps))
    if gone or str(proc.get("state", "")).startswith(("Z", "X")):
        return verdict("dead", "the process had exited before it could be read")
    return verdict("unknown", "nothing was captured that says what it was doing")


def analyze(incident: Path) -> Analysis:
    problems: list[str] = []
    meta = evidence.read_json_object(incident / "incident.json", problems) or {}
    known = {str(p.get("dir") or p.get("pid")): p for p in evidence.dicts(meta.get("processes"))}
    all_dirs = process_dirs(incident)
    everyone = process_tree.members(all_dirs, [evidence.read(p, known.get(p.name)) for p in all_dirs])
    pids = {m.pid for m in everyone}
    kids = [m for m in everyone if process_tree.is_child(m, pids)]
    tops = [m for m in everyone if m not in kids]
    dirs, found = [m.pdir for m in tops], [m.ev for m in tops]
    kid_verdicts = [process_tree.as_child(judge_evidence(m.pdir, m.ev, known.get(m.pdir.name)), m,
                                          any(k.parent == m.pid for k in kids)) for m in kids]
    ranks = [judge_evidence(p, ev, known.get(p.name)) for p, ev in zip(dirs, found)]
    ranks = [process_tree.explain(v, m, [(k, kv) for k, kv in zip(kids, kid_verdicts) if k.parent == m.pid])
             if any(k.parent == m.pid for k in kids) or v.verdict == "waiting-on-children" else v
             for v, m in zip(ranks, tops)]
    records = {v.rank: ev.record for v, ev in zip(ranks, found) if ev.record is not None and v.rank is not None}
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
    elif lockstep.left_the_lockstep(dirs)[0]:
        culprits, summary = lockstep.explain(dirs, ranks, Culprit)
    else:
        odd = _odd_one_out(ranks)
        lost = [v for v in ranks if v.verdict in ("dead", "unknown")]
        waiting = [v for v in ranks if v.verdict == "in-collective"]
        if lost and waiting and len(lost) + len(waiting) == len(ranks):
            culprits = [Culprit(v.rank, v.pid, v.detail, None) for v in lost]
            summary = (f"Rank{'s' if len(waiting) > 1 else ''} {', '.join(str(v.rank) for v in waiting)} "
                       f"wait{'' if len(waiting) > 1 else 's'} in "
                       f"{waiting[0].collective}; rank{'s' if len(lost) > 1 else ''} "
                       f"{', '.join(str(v.rank) for v in lost)}: {lost[0].detail}, so the one that did not join is there.")
        elif odd is not None:
            culprits.append(Culprit(odd.rank, odd.pid, f"{odd.verdict}: {odd.detail}", odd.location))
            summary = (f"{_who(odd)} is the odd one out: {odd.detail} at {odd.location or 'an unknown place'}, "
                       f"while the other ranks are {Counter(v.verdict for v in ranks if v is not odd).most_common(1)[0][0]}.")
        elif len(ranks) > 1 and len({v.verdict for v in ranks}) == 1 and ranks[0].verdict == "in-collective":
            summary = (f"Every rank here waits in the same collective ({ranks[0].collective}): the cause is outside "
                       "this node - a dead or slow peer on another node, or the network.")
        elif ranks and ranks[0].verdict in _LEADS_WITH_ITSELF:
            v = ranks[0]  # the detail names its own places: a stuck child and the parent's wait, two threads
            culprits.append(Culprit(v.rank, v.pid, f"{v.verdict}: {v.detail}", v.location))
            summary = (f"Rank {v.rank}: " if v.rank is not None else "" if v.verdict == "child-stuck" else f"{_who(v)}: ") + f"{v.detail}."
        elif ranks:
            v = ranks[0]
            culprits.append(Culprit(v.rank, v.pid, f"{v.verdict}: {v.detail}", v.location))
            summary = f"{_who(v)}: {v.detail}" + (f" at {v.location}." if v.location else ".")
        else:
            summary = "Nothing was captured that can be analysed."
    views = _own_job_views([(v.pid, ev.ras) for v, ev in zip(ranks, found) if ev.ras is not None], problems)
    summary, culprits = _with_ras(views, ranks, summary, culprits, from_trace=bool(diverged or mismatched))
    # A captured rank's node is the name its daemon gave; RAS's address stands only for ranks not captured.
    nodes = {(v.rank, v.pid): v.node for v in ranks}
    culprits = [replace(c, node=nodes.get((c.rank, c.pid)) or c.node) for c in culprits]
    rests_on = tuple(f"{_who(v).lower() if v.rank is None else _who(v)}: {', '.join(ev.used) or 'nothing readable'}"
                     for v, ev in zip(ranks, found))
    rests_on += tuple(f"{k.role} (pid {k.pid}): {', '.join(k.ev.used) or 'nothing readable'}" for k in kids)
    unreadable = tuple(problems) + tuple(p for ev in found for p in ev.problems) + tuple(p for k in kids for p in k.ev.problems)
    summary = gpu_events.explain(incident, ranks, summary, meta)  # an XID on a rank's GPU near its stop comes first
    return account(incident, meta, Analysis(summary, tuple(culprits), tuple(ranks), tuple(collectives), rests_on, unreadable,
                                            tuple(kid_verdicts)))


def _who(v: RankVerdict) -> str:
    return f"Rank {v.rank}" if v.rank is not None else f"pid {v.pid}"


def _own_job_views(views: list[tuple[int | None, ras.RasView]], problems: list[str]) -> list[ras.RasView]:
    """The RAS answers that are of the captured process's own job.

    A process started without NCCL_RAS_ADDR is asked on the default port, which
    another job on the node may hold: an answer whose list of live processes
    leaves out the very process it was taken for speaks of someone else.
    """
    out = []
    for pid, view in views:
        alive = {r.pid for r in view.ranks}
        if alive and pid is not None and pid not in alive:
            problems.append(f"{pid}/nccl-ras: the RAS answer lists processes {sorted(p for p in alive if p is not None)[:8]} "
                            f"but not pid {pid}: another job's service, not used")
            continue
        out.append(view)
    return out


def _with_ras(views: list[ras.RasView], ranks: list[RankVerdict], summary: str,
              culprits: list[Culprit], from_trace: bool) -> tuple[str, list[Culprit]]:
    """NCCL's job-wide view leads where it blames a rank: it sees ranks on other nodes, and ranks that are gone."""
    if not views:
        return summary, culprits
    view = ras.merge(views)
    waiting = [v for v in ranks if v.verdict == "in-collective" and v.rank is not None]
    what = (f"rank{'s' if len(waiting) > 1 else ''} {', '.join(str(v.rank) for v in waiting)} "
            f"wait{'' if len(waiting) > 1 else 's'} in {waiting[0].collective}") if waiting else None
    sentence, blamed = ras_blame.blame(view, what)
    if not blamed:
        return summary, culprits
    by_rank = {v.rank: v for v in ranks if v.rank is not None}

    def merely_here(c: Culprit) -> bool:  # blamed only for being what was captured here, waiting
        return not from_trace and c.rank in by_rank and by_rank[c.rank].verdict in _LIVE

    extra = {b.rank: b for b in blamed if b.rank is not None}
    kept = [replace(c, pid=c.pid if c.pid is not None else extra[c.rank].pid, node=c.node or extra[c.rank].node,
                    gpu=c.gpu if c.gpu is not None else extra[c.rank].gpu) if c.rank in extra else c
            for c in culprits if not merely_here(c)]
    named = {c.rank for c in kept if c.rank is not None}
    if all(b.rank in named for b in blamed):
        # Already named, with more (where it is, how it ended): RAS adds its node and GPU, and that it is gone.
        return (f"{summary} {sentence}" if view.missing else summary), kept
    lead = [Culprit(b.rank, b.pid, b.reason, by_rank[b.rank].location if b.rank in by_rank else None, b.node, b.gpu)
            for b in blamed if b.rank is None or b.rank not in named]
    # What this node saw follows NCCL's sentence; "every rank here waits" is what NCCL just explained.
    keep = summary and not summary.startswith(("Every rank here", "Nothing was captured"))
    return (f"{sentence} Here: {summary}" if keep else sentence or summary), lead + kept


# Verdicts of a process that is merely where the hang shows, not why.
_LIVE = frozenset({"in-collective", "waiting-on-gpu", "stream-deadlock", "lock-wait", "idle-python", "unknown",
                   "gpu-kernel-spinning", "waiting-on-children"})
# Verdicts whose detail is a whole sentence of places (a stuck child and the parent's wait; two threads).
_LEADS_WITH_ITSELF = frozenset({"child-stuck", "thread-deadlock", "gil-held-in-c"})


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
            elif len({_key(e.input_sizes) for e in present.values()}) > 1:
                mismatch = "different sizes: " + ", ".join(f"rank {r} {e.input_sizes}" for r, e in present.items())
            elif len({_key(e.input_dtypes) for e in present.values()}) > 1:
                mismatch = "different types: " + ", ".join(f"rank {r} {e.input_dtypes}" for r, e in present.items())
            if seq == top or missing or mismatch:
                out.append(Collective(pg, seq, first.name, entered, missing, sizes, mismatch))
    return out


def _key(value: Any) -> str:
    """A comparable form of a trace's sizes or types, whatever the trace holds there."""
    try:
        return json.dumps(value, default=repr)
    except (ValueError, RecursionError):
        return "?"
