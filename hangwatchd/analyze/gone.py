"""Ranks that are gone: job-mates that exited before the hang, and ranks this node never saw.

A rank that exits while its mates still wait in a collective (uneven data: it
ran out of batches; a peer SIGKILLed by the OOM killer) leaves nothing to
capture, and the ranks left behind all look alike: waiting. The daemon keeps
what it knew of an exited job-mate and writes it as ``PID/exit.json``; this
module counts the ranks against the job's world size, says of each one that
is not there whether it exited (how, when, after which collective) or is not
on this node, and puts a rank that exited before its mates stopped first.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..detect.patterns import is_user_frame
from . import flight
from .jsonfile import read_json_or_none
from .records import Analysis, Culprit, RankVerdict

MAX_EXIT_FILE = 1 << 20
MAX_WORLD = 1 << 20  # larger than any job: a world size past it is not believed
MAX_LISTED = 256  # absent ranks past this are named in the summary's ranges only, not one by one


@dataclass(frozen=True)
class Exited:
    dir: str
    rank: int | None
    pid: int | None
    world_size: int | None
    how: str
    time: float | None
    last_beat_time: float | None
    beats: int | None
    location: str | None
    job_hung: dict[str, Any] | None = None  # the rank whose hang made the incident, and its last progress


def _read_json(path: Path, cap: int = MAX_EXIT_FILE) -> Any:
    """A small regular file's JSON, never following a link or blocking; None when it is not one."""
    return read_json_or_none(path, cap, nofollow=True)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


MAX_TIME = 2.0**33  # seconds since 1970: the year 2242; a larger "time" is no time (and overflows localtime)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < MAX_TIME else None


def _how(data: dict[str, Any]) -> str:
    sig, status = _int(data.get("signal")), _int(data.get("status"))
    if sig is not None:
        name = data.get("signal_name") if isinstance(data.get("signal_name"), str) else None
        return f"was killed by signal {sig}" + (f" ({name})" if name else "")
    if status is not None:
        return f"exited with status {status}"
    return "exited"


def _stack_location(stack: Any) -> str | None:
    if not isinstance(stack, list):
        return None
    for thread in stack:
        for f in thread if isinstance(thread, list) else []:
            if isinstance(f, dict) and is_user_frame(f):
                return f"{f.get('name')} ({f.get('filename')}:{f.get('line')})"
    return None


def exited_ranks(incident: Path) -> list[Exited]:
    """Every ``PID/exit.json`` in the incident, read defensively (it may be put together by hand)."""
    out: list[Exited] = []
    try:
        dirs = sorted(p for p in incident.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return out
    for pdir in dirs:
        data = _read_json(pdir / "exit.json")
        if not isinstance(data, dict):
            continue
        pid = _int(data.get("pid")) or (int(pdir.name) if pdir.name.isdigit() else None)
        beats = _int(data.get("beats"))
        out.append(Exited(pdir.name, _int(data.get("rank")), pid, _int(data.get("world_size")), _how(data),
                          _num(data.get("time")), _num(data.get("last_beat_time")), beats,
                          _stack_location(data.get("last_stack")),
                          data["job_hung"] if isinstance(data.get("job_hung"), dict) else None))
    return sorted(out, key=lambda e: (e.time is None, e.time or 0.0, e.rank if e.rank is not None else 1 << 30))


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S %Z", time.localtime(t)).strip()


def _who(rank: int | None, pid: int | None) -> str:
    return f"Rank {rank}" if rank is not None else f"pid {pid}"


def _left_after(incident: Path, survivors: list[RankVerdict]) -> tuple[str, str] | None:
    """(what it last finished, what the survivors wait in) from the survivors' flight records.

    A collective completes only when every rank joined it: the last one the
    survivors completed is the last the exited rank took part in, the next
    one is where they wait for it.
    """
    records = []
    for v in survivors:
        if not isinstance(v.pid, int):
            continue
        rec = flight.load(incident / str(v.pid) / "flight-recorder.pkl")
        if rec is not None:
            records.append(rec)
    for pg in sorted({pg for r in records for pg in r.pg_status}):
        statuses = [r.pg_status[pg] for r in records if pg in r.pg_status]
        done = min(s[2] for s in statuses)
        if not any(s[0] > s[2] for s in statuses):
            continue
        last = next((r.entry(pg, done) for r in records if r.entry(pg, done)), None)
        waiting = next((r.entry(pg, done + 1) for r in records if r.entry(pg, done + 1)), None)
        return (f"{last.name if last else 'collective'} #{done}",
                f"{waiting.name if waiting else 'collective'} #{done + 1} (process group {pg})")
    return None


def _world_size(incident: Path, survivors: list[RankVerdict], exited: list[Exited], meta: dict[str, Any]) -> int | None:
    sizes = [e.world_size for e in exited if e.world_size and 0 < e.world_size <= MAX_WORLD]
    for v in survivors:
        if isinstance(v.pid, int):
            proc = _read_json(incident / str(v.pid) / "proc.json")
            if isinstance(proc, dict) and 0 < (_int(proc.get("world_size")) or 0) <= MAX_WORLD:
                sizes.append(proc["world_size"])
    for p in meta.get("processes") or [] if isinstance(meta.get("processes"), list) else []:
        if isinstance(p, dict) and 0 < (_int(p.get("world_size")) or 0) <= MAX_WORLD:
            sizes.append(p["world_size"])
    return max(sizes) if sizes else None


def _ranges(ranks: list[int]) -> str:
    """0, 2, 3, 4, 5, 9 as "0, 2-5, 9": a multi-node job's absent ranks in a line."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def account(incident: Path, meta: dict[str, Any], base: Analysis) -> Analysis:
    """``base`` with the ranks that are gone added, and led by one that exited before its mates stopped."""
    meta = meta if isinstance(meta, dict) else {}
    exited = exited_ranks(incident)
    gone_pids = {e.pid for e in exited if e.pid is not None}
    survivors = [v for v in base.ranks if not (isinstance(v.pid, int) and v.pid in gone_pids)]
    world = _world_size(incident, survivors, exited, meta)
    if not exited and not world:
        return base
    # When the job hung: incident.json once stored, else what the daemon wrote beside the exit.
    raw = meta.get("processes")
    listed = raw if isinstance(raw, list) else []
    hung = next((p for p in listed if isinstance(p, dict)), None)
    stopped = _num(meta.get("since"))
    if hung is None or stopped is None:
        hung = next((e.job_hung for e in exited if e.job_hung), None)
        stopped = _num(hung.get("since")) if hung else None
    hung_who = _who(_int(hung.get("rank")), _int(hung.get("pid"))).replace("Rank", "rank") if hung else None
    # An exit after the hang was declared is a consequence (a launcher tearing the job down), not the cause.
    declared = _num(meta.get("time")) or (_num(hung.get("declared")) if hung else None)
    after = _left_after(incident, survivors)
    lead: list[str] = []
    late: list[str] = []
    first: list[Culprit] = []
    later: list[Culprit] = []
    verdicts: list[RankVerdict] = []
    for e in exited:
        when = f" at {_clock(e.time)}" if e.time else ""
        detail = f"{e.how}{when}"
        if after:
            detail += f", after {after[0]}"
        verdicts.append(RankVerdict(e.rank, e.pid, "exited", detail, e.location))
        is_cause = not (e.time and declared and e.time > declared)
        sentence = f"{_who(e.rank, e.pid)} {e.how}{when}"
        if e.time and stopped and hung_who:
            gap = stopped - e.time
            if gap >= 0:
                sentence += f", {gap:.1f} s before {hung_who} stopped"
            elif is_cause:  # its mate had entered the next collective and was waiting for it
                sentence += f", while {hung_who} waited ({-gap:.1f} s after its last beat)"
            else:
                sentence += f", {-gap:.1f} s after {hung_who} stopped, once the hang was declared"
        if after and is_cause:
            sentence += f"; it left after {after[0]} and never joined {after[1]}"
            if survivors:
                names = ", ".join(_who(v.rank, v.pid).replace("Rank ", "rank ") for v in survivors)
                sentence += f", where {names} wait{'' if len(survivors) > 1 else 's'}"
        (lead if is_cause else late).append(sentence + ".")
        culprit = Culprit(e.rank, e.pid, detail, e.location)
        (first if is_cause else later).append(culprit)
    present = {v.rank for v in survivors if isinstance(v.rank, int)} | {e.rank for e in exited if e.rank is not None}
    missing = sorted(set(range(world)) - present) if world else []
    for r in missing[:MAX_LISTED]:
        verdicts.append(RankVerdict(r, None, "not-here", "not on this node: neither watched nor exited here", None))
    tail = []
    if missing:
        tail.append(f"Rank{'s' if len(missing) > 1 else ''} {_ranges(missing)} of world size {world} "
                    f"{'are' if len(missing) > 1 else 'is'} not on this node (neither watched nor exited here).")
    base_culprits = [c for c in base.culprits if not (isinstance(c.pid, int) and c.pid in gone_pids)]
    summary = " ".join(lead + [base.summary] + late + tail)
    return dataclasses.replace(base, summary=summary, culprits=tuple(first + base_culprits + later),
                               ranks=tuple(survivors + verdicts))
