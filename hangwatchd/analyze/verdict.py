"""Verdicts: what each captured process was doing, and which rank of a job diverged.

Works on any incident directory laid out as docs/design.md says, also one put
together by hand: a subdirectory per process holding any of proc.json,
pyspy(-native).json, symbolized.json, nvml.json, flight-recorder.pkl.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..cudacore import sandbox
from ..detect import patterns
from ..detect.patterns import is_user_frame
from . import (
    chain_text,
    evidence,
    flight,
    gpu_events,
    lockstep,
    process_graph,
    process_tree,
    ras,
    ras_blame,
    raw_dump,
    slow,
    stream_deadlock,
    surfaced,
    waitfor,
)
from . import threads as th
from .gone import account
from .records import Analysis, Collective, Culprit, RankVerdict
from .stacks import library_frames
from .waitfor import Graph


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
              "nccl-ras.txt", "nccl-ras.json", *raw_dump.NAMES)
    try:
        subdirs = [p for p in incident.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
    return sorted(p for p in subdirs if any((p / w).exists() for w in wanted))


def judge(pdir: Path, known: dict[str, Any] | None = None) -> RankVerdict:
    """One process's verdict from whatever was captured of it (``known``: what incident.json says of it)."""
    ev = evidence.read(pdir, known)
    pid = evidence.as_int(ev.proc.get("pid")) or (int(pdir.name) if pdir.name.isdigit() else None)
    graph = process_graph.build([process_graph.Proc(pid, ev, None, None, ev.exits, ev.report)]) if pid else None
    return judge_evidence(pdir, ev, known, graph)


def graph_verdict(graph: Graph, pid: int, child: bool = False) -> tuple[str, str, str | None, str] | None:
    """(kind, detail, location, certainty) from the root of the chain that starts at ``pid``'s main
    thread (``child``: a child captured with its hung parent, whose own verdict says only where it is)."""
    found = waitfor.chains(graph, process_graph.key(pid))
    if not found:
        return None
    chain = found[0]
    told = chain_text.tell(chain)
    sure = chain_text.certainty(chain, told)
    kind, detail, location = _graph_kind(graph, pid, child, chain, told)
    return kind, detail, location, sure


def _graph_kind(graph: Graph, pid: int, child: bool, chain: waitfor.Chain, told: chain_text.Told) -> tuple[str, str, str | None]:
    kind, sentence = told.kind, told.sentence
    root = told.culprit
    mine = process_graph.key(pid)
    in_child = root is not None and root.pid is not None and root.pid != pid
    if kind == "deadlock" and len({p.pid for p, _ in chain.cycle}) == 1:
        kind = "thread-deadlock"
        if not chain.sure and all(e.what == "a lock" for _, e in chain.cycle):
            sentence, location = _group_deadlock(graph, pid)
            return kind, sentence, location
    elif kind in ("blocked-io", "busy", "sleeping") and (in_child or child):
        kind = "child-stuck"
        if child and not in_child and root is not None:  # the child's own verdict: where it is stuck, and how
            sentence = f"stuck in {root.where or 'a system call'}, {root.doing}"
    elif kind == "gil-held":
        others = len([k for k in graph.parties if k.split("/")[0] == mine]) - 1
        sentence += ("; the other thread cannot run Python" if others == 1 else
                     f"; the other {others} threads cannot run Python" if others > 1 else "")
        if "spinning in C" in sentence:
            kind = "gil-held-in-c"
    elif kind == "idle" and not (chain.steps and "child processes" in chain.steps[0][1].what):
        kind = "idle-python"
        if child and root is not None and root.pid == pid:
            sentence = root.doing or sentence
    elif kind == "idle" and chain.steps and "child processes" in chain.steps[0][1].what:
        first, edge = chain.steps[0]
        kids = [graph.parties[e.holder] for e in graph.out(first.key) if e.holder]
        states = "; ".join(f"{k.label}: {k.doing or 'waits'}" for k in kids[:4])
        return ("waiting-on-children", f"waiting for its {len(kids)} child process{'es' if len(kids) != 1 else ''} "
                f"in {chain_text.at(first, edge) or edge.what}; none is stuck in code of its own ({states})", told.location)
    elif kind in ("nobody", "unknown-wait") and chain.steps and chain.steps[-1][1].what == "a lock":
        kind = "lock-wait"
    elif kind == "unknown-wait" and len(chain.steps) == 1 and "child processes" in chain.steps[0][1].what:
        first, edge = chain.steps[0]
        return ("waiting-on-children", f"waiting for its child processes in {chain_text.at(first, edge) or edge.what}; "
                "none was captured and no exit of one was recorded", told.location)
    return kind, sentence, told.location


def _group_deadlock(graph: Graph, pid: int) -> tuple[str, str | None]:
    """Threads that each wait for a lock, none running: a deadlock whose locks the stacks do not name
    (listed in the order they were started: thread ids grow)."""
    prefix = process_graph.key(pid)
    waiting = [(k, graph.parties[k]) for k, edges in graph.edges.items()
               if k.split("/")[0] == prefix and any(e.what == "a lock" for e in edges)]
    waiting.sort(key=lambda kp: int(kp[0].rsplit("/t", 1)[1]) if "/t" in kp[0] else pid)
    named = [f"{p.label.removeprefix('thread ')} ({p.where.replace(' (', ', ', 1) if p.where else '?)'}" for _, p in waiting]
    text = "deadlock between threads " + (", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0])
    return text, waiting[0][1].location if waiting else None


def judge_evidence(pdir: Path, ev: evidence.Evidence, known: dict[str, Any] | None = None,
                   graph: Graph | None = None) -> RankVerdict:
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

    def verdict(kind: str, detail: str, loc: str | None = location, coll: str | None = None, sure: str = "") -> RankVerdict:
        return RankVerdict(rank, pid, kind, detail, loc, coll, last, proc.get("node"), certainty=sure)

    def full(f: dict[str, Any] | None) -> str | None:
        return _where(f) if f else None

    for exc in evidence.dicts(sym.get("exceptions")):
        frames = evidence.dicts(exc.get("frames"))
        frame = next((f for f in frames if f.get("file")), None)
        loc = f"{frame.get('function')} ({frame.get('file')}:{frame.get('line')})" if frame else exc.get("kernel")
        detail = f"{exc.get('type', 'an exception')} in {surfaced.short_name(str(exc.get('kernel')))}"
        chain = surfaced.kernel_chain(frames)
        detail += f" at {chain}" if chain else " (no source lines in its cubin)" if frames else ""
        at = surfaced.in_evidence(threads, ev.report)
        if at is None:
            return verdict("gpu-exception", detail, loc, sure="sure: the GPU dump names the exception and the kernel")
        return verdict("gpu-exception", f"{detail}, surfaced in {at.text()}; {surfaced.ASYNC_NOTE}", at.location,
                       sure="sure: the GPU dump names the exception and the kernel; the line is where the host learned of it")
    kernels = [str(k["name"]) for k in stream_deadlock.kernels_on(sym, gpus)]
    nccl = [k for k in kernels if "nccl" in k.lower()]
    if nccl:
        return verdict("in-collective", f"NCCL kernel {nccl[0]} running{gpu_busy}", location, pending or nccl[0],
                       sure="sure: the GPU dump shows the NCCL kernel running")
    pcs = [p for p in evidence.dicts(sym.get("pcs")) if not gpus or p.get("device") in gpus]
    if kernels and pcs:
        p = pcs[0]
        frame = next((f for f in evidence.dicts(p.get("frames")) if f.get("file")), None)
        loc = f"{frame.get('function')} ({frame.get('file')}:{frame.get('line')})" if frame else kernels[0]
        return verdict("gpu-kernel-spinning", f"kernel {kernels[0]} still running, {p.get('warps')} warps at {p.get('pc')}{gpu_busy}", loc,
                       sure="sure: the GPU dump shows its warps on the SMs")
    names = [str(f.get("name") or "") for t in threads for f in t.get("frames") or []]
    coll = patterns.first(names, patterns.COLLECTIVE)
    if pending or coll:
        return verdict("in-collective", f"waiting in {pending or coll}", location, pending or coll,
                       sure="sure: the flight recorder has it enqueued and not completed" if pending else
                       "inferred: a collective's frame in its stacks (no flight recorder)")
    p2p = _point_to_point(threads)
    if p2p:
        return verdict("in-collective", f"waiting in {p2p} (point to point: for its peer's matching "
                       f"{'recv' if p2p.endswith('send') else 'send'})", location, p2p,
                       sure="inferred: torch.distributed's point-to-point frame in its stacks")
    gpu = patterns.first(names, patterns.GPU)
    in_driver = bool(library_frames(threads))
    if gpu or in_driver:
        call = stream_deadlock.driver_call(tuple(threads)) or gpu or "the CUDA driver"
        idle = stream_deadlock.idle_gpu(sym, nvml, pid) if in_driver or ev.native else None
        if idle:
            lazy = f" ({stream_deadlock.LAZY_NOTE})" if stream_deadlock.LAZY_LOAD.match(call) else ""
            return verdict("stream-deadlock", f"host blocked in {call}{lazy} while {idle}: it waits for GPU work that "
                                              f"never runs; {stream_deadlock.WHAT_TO_LOOK_AT}",
                           sure="sure: the GPU dump shows no kernel of it running" if sym.get("kernels") is not None or
                           sym.get("pcs") is not None else "inferred: NVML's per-process samples (5 s) show nothing of it running")
        return verdict("waiting-on-gpu", f"host blocked in {call}{gpu_busy}",
                       sure="unknown: nothing read says whether its GPU work still completes")
    if graph is not None and pid is not None:
        told = graph_verdict(graph, pid, child=bool(proc.get("role")) and proc.get("parent") is not None)
        if told is not None:
            kind, detail, where, sure = told
            return verdict(kind, detail, where or location, sure=sure)
    if threads:
        return verdict("idle-python", "in Python, waiting on nothing known" if location else "in Python",
                       sure="unknown: its stacks name no wait")
    steps = (known or {}).get("steps") if isinstance((known or {}).get("steps"), list) else []
    gone = any("is gone" in str(s.get("error")) for s in evidence.dicts(steps))
    if gone or str(proc.get("state", "")).startswith(("Z", "X")):
        return verdict("dead", "the process had exited before it could be read", sure="sure: /proc had no such process")
    return verdict("unknown", "nothing was captured that says what it was doing", sure="unknown: nothing was captured")


def analyze(incident: Path, raw_dumps: sandbox.Limits | None = None) -> Analysis:
    """The verdict on an incident directory. ``raw_dumps``: a process directory's raw GPU dump without
    symbolized.json is symbolised, in the sandbox under these limits (``hangwatchd analyze``)."""
    paced = slow.analyze_dir(incident)  # a slow job's incident: its ranks are not hung, their pace says who and why
    if paced is not None:
        return paced
    problems: list[str] = []
    meta = evidence.read_json_object(incident / "incident.json", problems) or {}
    known = {str(p.get("dir") or p.get("pid")): p for p in evidence.dicts(meta.get("processes"))}
    all_dirs = process_dirs(incident)
    everyone = process_tree.members(all_dirs, [evidence.read(p, known.get(p.name), raw_dumps) for p in all_dirs])
    pids = {m.pid for m in everyone}
    kids = [m for m in everyone if process_tree.is_child(m, pids)]
    tops = [m for m in everyone if m not in kids]
    dirs, found = [m.pdir for m in tops], [m.ev for m in tops]
    graph = process_graph.build([process_graph.Proc(m.pid, m.ev, m.parent if m in kids else None, m.role if m in kids else None,
                                                    m.ev.exits, m.ev.report) for m in everyone if m.pid is not None])
    kid_verdicts = [process_tree.as_child(judge_evidence(m.pdir, m.ev, known.get(m.pdir.name), graph), m,
                                          any(k.parent == m.pid for k in kids)) for m in kids]
    ranks = [judge_evidence(p, ev, known.get(p.name), graph) for p, ev in zip(dirs, found)]
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
            at = "" if _says_where(odd) else f" at {odd.location or 'an unknown place'}"
            summary = (f"{_who(odd)} is the odd one out: {odd.detail}{at}, "
                       f"while the other ranks are {Counter(v.verdict for v in ranks if v is not odd).most_common(1)[0][0]}.")
        elif len(ranks) > 1 and (crossed := _crossed(ranks)) is not None:
            summary, culprits = crossed
        elif len(ranks) > 1 and len({v.verdict for v in ranks}) == 1 and ranks[0].verdict == "in-collective" \
                and (apart := _apart(ranks, found)) is not None:
            summary, culprits = apart
        elif len(ranks) > 1 and len({v.verdict for v in ranks}) == 1 and ranks[0].verdict == "in-collective":
            summary = (f"Every rank here waits in the same collective ({ranks[0].collective}) at the same place, "
                       "with the same arguments: the cause is outside this node - a dead or slow peer on another node, "
                       "or the network.")
        elif ranks and _says_where(ranks[0]):
            v = ranks[0]  # the detail names its own places: a stuck child and the parent's wait, two threads
            culprits.append(Culprit(v.rank, v.pid, f"{v.verdict}: {v.detail}", v.location))
            summary = (f"Rank {v.rank}: " if v.rank is not None else "" if v.verdict == "child-stuck" else f"{_who(v)}: ") + f"{v.detail}."
        elif ranks:
            v = ranks[0]
            culprits.append(Culprit(v.rank, v.pid, f"{v.verdict}: {v.detail}", v.location))
            summary = f"{_who(v)}: {v.detail}" + (f" at {_short_where(v.location)}." if v.location else ".")
        else:
            summary = "Nothing was captured that can be analysed."
    views = _own_job_views([(v.pid, ev.ras) for v, ev in zip(ranks, found) if ev.ras is not None], problems)
    summary, culprits = _with_ras(views, ranks, summary, culprits, from_trace=bool(diverged or mismatched))
    # A captured rank's node is the name its daemon gave; RAS's address stands only for ranks not captured.
    nodes = {(v.rank, v.pid): v.node for v in ranks}
    culprits = [replace(c, node=nodes.get((c.rank, c.pid)) or c.node) for c in culprits]
    rests_on = tuple(f"{_who(v).lower() if v.rank is None else _who(v)}: {', '.join(ev.used) or 'nothing readable'}"
                     + (f"; {v.certainty}" if v.certainty else "") for v, ev in zip(ranks, found))
    rests_on += tuple(f"{k.role} (pid {k.pid}): {', '.join(k.ev.used) or 'nothing readable'}" for k in kids)
    unreadable = tuple(problems) + tuple(p for ev in found for p in ev.problems) + tuple(p for k in kids for p in k.ev.problems)
    # A GPU fault near a rank's stop comes first; another process's fault on its GPU is said after.
    summary, blame = gpu_events.judge(list(zip(dirs, ranks)), summary, meta)
    return account(incident, meta, Analysis(summary, tuple(culprits), tuple(ranks), tuple(collectives), rests_on, unreadable,
                                            tuple(kid_verdicts), blame=blame))


P2P = ("send", "recv")  # the blocking ones: isend and irecv return, and wait in Work.wait


def _point_to_point(threads: list[dict[str, Any]]) -> str | None:
    """torch.distributed's send or recv that a thread waits in (its frame in distributed_c10d.py): a
    blocking point-to-point call waits for the peer's matching call, not for every rank."""
    for t in threads:
        for f in t.get("frames") or []:
            name = str(f.get("name") or "").rsplit(".", 1)[-1]
            if name in P2P and str(f.get("filename") or "").endswith("torch/distributed/distributed_c10d.py"):
                return name
    return None


def _crossed(ranks: list[RankVerdict]) -> tuple[str, list[Culprit]] | None:
    """Every rank waits in a point-to-point send (or every one in a recv): each waits for a peer that
    is itself sending (receiving), so no matching call will ever come: the order of the ranks' sends
    and receives deadlocks (one side must receive first)."""
    ops = {v.collective for v in ranks}
    if any(v.verdict != "in-collective" or v.rank is None for v in ranks) or len(ops) != 1 or not ops <= set(P2P):
        return None
    op = ops.pop()
    other = "recv" if op == "send" else "send"
    at = ", ".join(f"rank {v.rank} at {_short_where(v.location) if v.location else 'an unknown place'}"
                   for v in sorted(ranks, key=lambda v: v.rank or 0))
    summary = (f"Every rank waits in {op} and none in {other}: a {op} waits for its peer's matching {other}, and each peer "
               f"is in {op} itself, so none will come ({at}): the order of the ranks' sends and receives deadlocks "
               f"(one side must {'receive' if op == 'send' else 'send'} first, or use isend/irecv).")
    return summary, [Culprit(v.rank, v.pid, f"waits in {op}, as its peer does", v.location) for v in ranks]


def _apart(ranks: list[RankVerdict], found: list[evidence.Evidence]) -> tuple[str, list[Culprit]] | None:
    """Ranks that all wait in a collective, but not the same one: a different collective, the same one
    called from another place, or with another source or destination (py-spy's locals). The ranks in
    the minority are the ones that never reached the collective the others wait in; where the ranks
    split evenly, each side never reached the other's, and both are named."""
    def site(v: RankVerdict, ev: evidence.Evidence) -> tuple[str, str, str]:
        return (v.collective or "?", v.location or "?", _collective_args(ev))

    keyed = [(v, site(v, ev)) for v, ev in zip(ranks, found) if v.rank is not None]
    groups: dict[tuple[str, str, str], list[RankVerdict]] = {}
    for v, k in keyed:
        groups.setdefault(k, []).append(v)
    if len(groups) < 2:
        return None
    names = {k[0] for k in groups}
    places = {k[1] for k in groups}
    order = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(v.rank or 0 for v in kv[1])))

    def who(vs: list[RankVerdict]) -> str:
        return f"rank{'s' if len(vs) > 1 else ''} {', '.join(str(v.rank) for v in sorted(vs, key=lambda v: v.rank or 0))}"

    def what(k: tuple[str, str, str]) -> str:
        where = f"{k[0]} at {_short_where(k[1])}"
        return where + (f" with {k[2]}" if k[2] and len(names) == 1 and len(places) == 1 else "")

    (top, most), rest = order[0], order[1:]
    if len(names) == 1 and len(places) == 1:  # the same call, made with different peers: a mismatch
        sides = "; ".join(f"{who(vs)} with {k[2]}" for k, vs in sorted(order, key=lambda kv: -min(v.rank or 0 for v in kv[1])))
        odd = [v for _, vs in rest for v in vs] if len(most) > max(len(vs) for _, vs in rest) else [v for _, vs in order for v in vs]
        summary = (f"Ranks disagree in {top[0]} at {_short_where(top[1])}: {sides}: a mismatch, each waits for a "
                   "peer that is not in the same exchange.")
        return summary, [Culprit(v.rank, v.pid, f"{top[0]} with {site(v, ev)[2]}", v.location)
                         for v, ev in zip(ranks, found) if v in odd]
    if len(most) > max(len(vs) for _, vs in rest):  # a majority: the others left the collective it waits in
        odd = [v for _, vs in rest for v in vs]
        summary = (f"{who(odd).capitalize()} never entered {top[0]} that {who(most)} wait{'s' if len(most) == 1 else ''} in "
                   f"at {_short_where(top[1])}: " + "; ".join(f"{who(vs)} {'is' if len(vs) == 1 else 'are'} in {what(k)} instead"
                                                            for k, vs in rest) + ".")
        culprits = [Culprit(v.rank, v.pid, f"never entered {top[0]} at {_short_where(top[1])}", v.location) for v in odd]
        return summary, culprits
    # An even split: each side waits in what the other never reached.
    sides = "; ".join(f"{who(vs)} in {what(k)}" for k, vs in sorted(order, key=lambda kv: -min(v.rank or 0 for v in kv[1])))
    differ = ("different collectives" if len(names) > 1 else "the same collective called from different places"
              if len(places) > 1 else f"{top[0]} with different arguments")
    first = sorted(order, key=lambda kv: -min(v.rank or 0 for v in kv[1]))
    other = first[1][1]
    lead = (f"{who(first[0][1]).capitalize()} never entered {first[1][0][0]} that {who(other)} "
            f"wait{'s' if len(other) == 1 else ''} in, and the other way round")
    summary = f"{lead}: the ranks wait in {differ}: {sides}."
    culprits = [Culprit(v.rank, v.pid, f"waits in {what(k)}", v.location) for k, vs in first for v in vs]
    return summary, culprits


_COLLECTIVE_ARGS = ("src", "dst", "group_src", "group_dst")  # who meets whom (an op's repr holds an address)


def _collective_args(ev: evidence.Evidence) -> str:
    """The arguments that decide who meets whom in the innermost collective frame (py-spy's locals):
    ``src=1``; "" where the stacks hold none."""
    for t in th.ordered(list(ev.threads)):
        for f in t.get("frames") or []:
            if patterns.first([str(f.get("name") or "")], patterns.COLLECTIVE) and f.get("locals"):
                args = [f"{v['name']}={v['repr']}" for v in f["locals"]
                        if v.get("name") in _COLLECTIVE_ARGS and v.get("repr") not in (None, "None")]
                return ", ".join(args)
    return ""


def _short_where(location: str) -> str:
    """``fn (/a/b/x.py:9)`` as ``fn (x.py:9)``."""
    name, _, rest = location.partition(" (")
    return f"{name} ({os.path.basename(rest)}" if rest else location


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
def _says_where(v: RankVerdict) -> bool:
    """The verdict's detail is a whole sentence of places (the root of a wait-for chain and how the
    hung party reaches it; a stuck child and the parent's wait): it is said as it is, not followed by
    'at LOCATION'."""
    if v.verdict in ("child-stuck", "thread-deadlock", "gil-held-in-c"):
        return True
    if not v.location or " (" not in v.location:
        return False
    name, _, rest = v.location.partition(" (")
    short = f"({os.path.basename(rest.rsplit(':', 1)[0])}:{rest.rsplit(':', 1)[-1]}"
    return short in v.detail or short.replace("(", ", ", 1) in v.detail


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
