"""NCCL's RAS answer (nccl-ras.txt, nccl-ras.json) read into one job-wide view.

NCCL's RAS service (2.24+) answers for the whole job, across nodes: every
rank (host, pid, GPU), every communicator, how many collectives each rank
launched, and which ranks are missing or dead. It prints text, and since
2.27 JSON. NCCL 2.28.9's JSON for missing ranks is not valid (no comma after
``"nvml_dev"``); the reader mends that one fault, and the text form carries
the same facts, so either file alone is enough. The files come from a
workload's service: the reader caps what it reads and never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_BYTES = 16 << 20
MAX_RANKS = 65536  # per communicator; beyond that the answer is not one we believe


@dataclass(frozen=True)
class RasRank:
    rank: int | None  # None where NCCL names only the process (its DEAD list)
    node: str | None
    pid: int | None
    gpu: int | None
    state: str  # alive, missing (unresponsive), dead
    communicator: str | None = None


@dataclass(frozen=True)
class RasCount:
    rank: int
    count: int
    node: str | None = None
    pid: int | None = None
    gpu: int | None = None


@dataclass(frozen=True)
class RasMismatch:
    """A communicator whose ranks launched different numbers of one collective."""

    communicator: str
    collective: str  # AllReduce, AllGather, ...
    counts: tuple[RasCount, ...]

    @property
    def behind(self) -> tuple[RasCount, ...]:
        low = min(c.count for c in self.counts)
        return tuple(c for c in self.counts if c.count == low)

    @property
    def ahead(self) -> int:
        return max(c.count for c in self.counts)


@dataclass(frozen=True)
class RasView:
    version: str | None
    ranks: tuple[RasRank, ...]  # alive ones, as NCCL listed them
    missing: tuple[RasRank, ...]  # missing or dead, with the rank where NCCL knows it
    mismatches: tuple[RasMismatch, ...]
    communicators: tuple[str, ...]
    source: str  # which file said it

    @property
    def empty(self) -> bool:
        return not (self.ranks or self.missing or self.mismatches or self.communicators)


def read(process_dir: Path) -> tuple[RasView | None, tuple[str, ...]]:
    """The RAS view captured with one process (JSON preferred, text otherwise), and what could not be read."""
    problems: list[str] = []
    views = []
    for name, parse in (("nccl-ras.json", parse_json), ("nccl-ras.txt", parse_text)):
        path = process_dir / name
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_BYTES)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{process_dir.name}/{name}: cannot be read ({exc.strerror or exc})")
            continue
        text = raw.decode("utf-8", "replace")
        view, why = parse(text)
        if view is None:
            problems.append(f"{process_dir.name}/{name}: {why}")
        else:
            views.append(view)
    if not views:
        return None, tuple(problems)
    return merge(views), tuple(problems)


def merge(views: list[RasView]) -> RasView:
    """One view from several answers (JSON and text, or several ranks' copies): facts are added, never lost."""
    def key(r: RasRank) -> tuple[Any, ...]:
        return (r.rank, r.pid, r.node) if r.rank is not None else (None, r.pid, r.node)

    missing: dict[tuple[Any, ...], RasRank] = {}
    for v in views:
        for r in v.missing:
            k = key(r)
            old = missing.get(k)
            if old is None or (r.state == "dead" and old.state != "dead"):
                missing[k] = r
    # A process NCCL calls dead, known elsewhere by its rank: one entry, with the rank, dead.
    named = {(r.pid, r.node): r for r in missing.values() if r.rank is not None}
    for k, r in list(missing.items()):
        if r.rank is None and (r.pid, r.node) in named:
            del missing[k]
            if r.state == "dead":
                n = named[(r.pid, r.node)]
                missing[key(n)] = RasRank(n.rank, n.node, n.pid, n.gpu if n.gpu is not None else r.gpu, "dead", n.communicator)
    # NCCL 2.24 names the missing rank by number and the missing process apart: one of each is one rank.
    bare = [k for k, r in missing.items() if r.rank is not None and r.pid is None]
    procs = [k for k, r in missing.items() if r.rank is None]
    if len(bare) == 1 and len(procs) == 1:
        r, p = missing.pop(bare[0]), missing.pop(procs[0])
        joined = RasRank(r.rank, p.node, p.pid, p.gpu, p.state if p.state == "dead" else r.state, r.communicator)
        missing[key(joined)] = joined
    ranks = {key(r): r for v in views for r in v.ranks}
    mismatches = {(m.communicator, m.collective): m for v in views for m in v.mismatches}
    comms = tuple(dict.fromkeys(c for v in views for c in v.communicators))
    first = views[0]
    return RasView(first.version or next((v.version for v in views if v.version), None), tuple(ranks.values()),
                   tuple(sorted(missing.values(), key=lambda r: (r.rank is None, r.rank or 0, r.pid or 0))),
                   tuple(mismatches.values()), comms, "+".join(dict.fromkeys(v.source for v in views)))


# -- JSON ----------------------------------------------------------------------------

# NCCL 2.28.9 writes '"nvml_dev": 1' and the next '"status": {' with no comma between.
def _mend_commas(text: str) -> str:
    """NCCL 2.28.9's answer with its missing commas put back: a line that ends in a value (a
    number, a string, true/false/null, a closed object or list) followed by a line that starts
    with a key gets a comma. One look at each line's last character: linear in the answer."""
    lines = text.split("\n")
    for i in range(len(lines) - 1):
        end = lines[i].rstrip()[-1:]
        if end and (end in '"}]el' or end.isdigit()) and lines[i + 1].lstrip().startswith('"'):
            lines[i] += ","
    return "\n".join(lines)


def parse_json(text: str) -> tuple[RasView | None, str]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        try:
            data = json.loads(_mend_commas(text))
        except (ValueError, RecursionError) as exc:
            return None, f"not JSON, even with NCCL 2.28.9's missing commas put back ({str(exc)[:100]})"
    if not isinstance(data, dict) or not isinstance(data.get("communicators"), list):
        return None, "JSON without a list of communicators: not a RAS answer"
    ranks: list[RasRank] = []
    missing: list[RasRank] = []
    mismatches: list[RasMismatch] = []
    comms: list[str] = []
    for comm in data["communicators"][:MAX_RANKS]:
        if not isinstance(comm, dict):
            continue
        name = _short_hash(comm.get("hash"))
        comms.append(name)
        counts: dict[str, list[RasCount]] = {}
        for r in _list(comm.get("ranks")):
            rank = _int(r.get("rank"))
            one = RasRank(rank, _str(r.get("host")), _int(r.get("pid")), _int(r.get("cuda_dev")), "alive", name)
            ranks.append(one)
            cc = r.get("collective_counts")
            if rank is not None and isinstance(cc, dict):
                for coll, n in list(cc.items())[:64]:
                    if _int(n) is not None:
                        counts.setdefault(coll[:64], []).append(RasCount(rank, _int(n) or 0, one.node, one.pid, one.gpu))
        for r in _list(comm.get("missing_ranks")):
            raw_status = r.get("status")
            status = raw_status if isinstance(raw_status, dict) else {}
            dead = status.get("considered_dead") is True
            missing.append(RasRank(_int(r.get("rank")), _str(r.get("host")), _int(r.get("pid")), _int(r.get("cuda_dev")),
                                   "dead" if dead else "missing", name))
        for coll, cs in counts.items():
            if len({c.count for c in cs}) > 1:
                mismatches.append(RasMismatch(name, coll, tuple(sorted(cs, key=lambda c: c.rank))))
    return RasView(_str(data.get("nccl_version")), tuple(ranks), tuple(missing), tuple(mismatches), tuple(comms), "json"), ""


def _list(value: Any) -> list[dict[str, Any]]:
    return [x for x in value[:MAX_RANKS] if isinstance(x, dict)] if isinstance(value, list) else []


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _str(value: Any) -> str | None:
    return value[:256] if isinstance(value, str) and value else None


def _short_hash(value: Any) -> str:
    s = value[:64] if isinstance(value, str) and value else str(value)[:64] if isinstance(value, int) else "?"
    return s[2:] if s.startswith("0x") else s


# -- text ----------------------------------------------------------------------------

_VERSION = re.compile(r"^NCCL version (\S+)")
_COMM = re.compile(r"^#(\S+) \(([0-9a-fA-Fx]+)\) ([A-Z,]+)\s*$")
_DIFFERENT = re.compile(r"have different (\w+) operation counts")
_LAUNCHED = re.compile(r"^\s*Rank (\d+) has launched up to operation (\d+) -- GPU (\d+)\S* managed by process (\d+) on node (\S+)")
_MISSING_RANK = re.compile(r"^\s*Rank (\d+) -- GPU (\d+)\S* managed by process (\d+) on node (\S+)")
_PROCESS = re.compile(r"^\s*Process (\d+) on node (\S+) managing GPUs? (\d+)")
_RANK_NUMBERS = re.compile(r"^\s*The missing ranks?: ([\d, ]+)")  # NCCL 2.24's form: numbers only


def parse_text(text: str) -> tuple[RasView | None, str]:
    version = None
    section = ""  # the unindented heading we are under (Errors, DEAD, #0-0 ..., Warnings)
    comm = None
    collective = None
    describe = ""  # the first line under a heading: what the block is about
    missing: list[RasRank] = []
    counts: dict[tuple[str, str], list[RasCount]] = {}
    comms: list[str] = []
    for line in text.splitlines()[:200_000]:
        line = line[:1024]
        m = _VERSION.match(line)
        if m:
            version = m.group(1)
            continue
        if line and not line[0].isspace():
            section = line.strip()
            m = _COMM.match(line)
            comm = _short_hash(m.group(2)) if m else None
            if comm and comm not in comms:
                comms.append(comm)
            collective = None
            describe = ""
            continue
        if not describe and line.strip():
            describe = line.strip()
        m = _DIFFERENT.search(line)
        if m:
            collective = m.group(1)
            continue
        m = _LAUNCHED.match(line)
        if m and comm and collective:
            rank, n, gpu, pid, node = int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5)
            counts.setdefault((comm, collective), []).append(RasCount(rank, n, node, pid, gpu))
            continue
        lists_missing = describe.startswith("Missing communicator data")
        m = _MISSING_RANK.match(line)
        if m and comm and lists_missing:
            missing.append(RasRank(int(m.group(1)), m.group(4), int(m.group(3)), int(m.group(2)), "missing", comm))
            continue
        m = _RANK_NUMBERS.match(line)
        if m and comm and lists_missing:
            missing += [RasRank(int(n), None, None, None, "missing", comm) for n in re.findall(r"\d+", m.group(1))[:MAX_RANKS]]
            continue
        m = _PROCESS.match(line)
        if m and (section.startswith("DEAD") or lists_missing):
            state = "dead" if section.startswith("DEAD") else "missing"
            missing.append(RasRank(None, m.group(2), int(m.group(1)), int(m.group(3)), state))
    if version is None and not comms and not missing:
        return None, "no NCCL RAS report in it (no version line, no communicator)"
    mismatches = tuple(RasMismatch(c, coll, tuple(sorted(cs, key=lambda x: x.rank)))
                       for (c, coll), cs in counts.items() if len({x.count for x in cs}) > 1)
    view = RasView(version, (), tuple(missing), mismatches, tuple(comms), "text")
    return merge([view]), ""
