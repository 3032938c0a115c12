"""The ledger of suspects: which GPUs and nodes the incidents' verdicts blamed, and for which jobs and users.

A few GPUs and nodes cause a large share of a fleet's failures. Each incident
whose verdict rests on a GPU fault (``analysis.blame``: a fault of the GPU or
the node, or a program's own fault on that GPU) leaves one entry here, named
by the incident: ``STATE_DIR/ledger/ID.json``, root's alone (it names every
user's jobs). The store writes it whenever it writes the incident's record
(first, and again when late evidence changes the verdict), and takes it away
when the verdict no longer blames a GPU; it outlives the incident itself
(retention removes incidents, never their entries), the newest ``MAX_ENTRIES``
kept. Each node sends its entries to the shared store beside its incidents
(``ledger/NODE/ID.json``, ``fleet/uploader.py``), so one reading sees the fleet.

``suspects`` reads entries together, per GPU (by UUID) and per node: the
incidents, jobs and users that implicate each, and a score that grows with
*distinct* jobs and users (``jobs + users - 1``): one buggy job hitting the same
GPU again and again is the job, not the GPU (it scores 1 however many times),
while two users' jobs failing on one GPU score 3. ``hangwatchd health`` reports
a node problem when a GPU of the node is implicated by ``suspect_jobs``
different jobs within ``suspect_window``. Entries read back from the store
were written by any node: ``parse`` checks every field before it counts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..host.atomic import write_atomic

LEDGER = "ledger"
MAX_ENTRIES = 10_000  # entries kept in a state dir, the newest (an entry is about 1 KB)
MAX_ENTRY = 64 << 10  # bytes of one entry read (a real one is about 1 KB)
MAX_BLAMES = 64  # blames of one entry counted (one a process of the incident)
MAX_TEXT = 500  # characters of one text field kept
KINDS = ("gpu", "application")
VERSION = 1


def _text(v: Any, cap: int = MAX_TEXT) -> str | None:
    return v[:cap] if isinstance(v, str) and v else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def job_key(job: str | None, uid: int | None, cmdline: Iterable[str] = ()) -> str:
    """What counts as one job: (owner, name), as everywhere in hangwatchd; a process with no job
    name is known by its command line (the same script run again is the same job)."""
    name = f"job {job}" if job else "cmd " + " ".join(cmdline)[:200]
    return f"{uid if uid is not None else '?'}:{name}"


def entry_of(data: dict[str, Any]) -> dict[str, Any] | None:
    """The ledger entry of an incident record (incident.json's content), or None when its verdict blames no GPU."""
    analysis = data.get("analysis") if isinstance(data.get("analysis"), dict) else {}
    blames = [b for b in (analysis or {}).get("blame") or [] if isinstance(b, dict)]
    if not blames or not _text(data.get("id")):
        return None
    procs = [p for p in data.get("processes") or [] if isinstance(p, dict)]
    uid = next((_int(p.get("uid")) for p in procs if _int(p.get("uid")) is not None), None)
    cmdline: list[Any] = next((p["cmdline"] for p in procs if isinstance(p.get("cmdline"), list)), [])
    node = _text(data.get("node")) or _text(data.get("host"))
    return {
        "v": VERSION, "incident": data["id"], "time": _num(data.get("time")) or time.time(), "node": node,
        "job": _text(data.get("job")), "job_key": job_key(_text(data.get("job")), uid, [str(w) for w in cmdline]),
        "uid": uid, "user": user_name(uid), "verdict": _text(data.get("verdict"), 1000),
        "blames": [{**b, "node": b.get("node") or node} for b in blames[:MAX_BLAMES]],
    }


def parse(raw: Any) -> dict[str, Any] | None:
    """An entry as it may be counted: every field checked and capped, or None (from another node, or damaged)."""
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        return None
    incident, when, key = _text(raw.get("incident"), 80), _num(raw.get("time")), _text(raw.get("job_key"), 300)
    if incident is None or when is None or key is None:
        return None
    blames = []
    for b in raw.get("blames") or []:
        if not isinstance(b, dict) or b.get("kind") not in KINDS:
            continue
        blames.append({"kind": b["kind"], "why": _text(b.get("why")) or "", "node": _text(b.get("node"), 255),
                       "gpu": _int(b.get("gpu")), "uuid": _text(b.get("uuid"), 80), "serial": _text(b.get("serial"), 80),
                       "pci": _text(b.get("pci"), 40), "xid": _int(b.get("xid")), "pid": _int(b.get("pid")),
                       "rank": _int(b.get("rank")), "time": _num(b.get("time"))})
        if len(blames) >= MAX_BLAMES:
            break
    if not blames:
        return None
    return {"v": VERSION, "incident": incident, "time": when, "node": _text(raw.get("node"), 255),
            "job": _text(raw.get("job"), 255), "job_key": key, "uid": _int(raw.get("uid")),
            "user": _text(raw.get("user"), 64), "verdict": _text(raw.get("verdict"), 1000), "blames": blames}


# -- the state dir's ledger ----------------------------------------------------------

def directory(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / LEDGER


def write(state_dir: str | os.PathLike[str], data: dict[str, Any]) -> dict[str, Any] | None:
    """Keep (or take away) the entry of the incident ``data`` records; the entry, or None when it blames
    no GPU. OSError when the state dir cannot take it (the incident is stored all the same)."""
    entry = entry_of(data)
    d = directory(state_dir)
    name = f"{data.get('id')}.json"
    if "/" in name or name.startswith("."):
        return None
    if entry is None:
        (d / name).unlink(missing_ok=True)
        return None
    d.mkdir(mode=0o700, exist_ok=True)
    write_atomic(d / name, json.dumps(entry, indent=1).encode(), mode=0o600)
    _trim(d)
    return entry


def _trim(d: Path, keep: int = MAX_ENTRIES) -> None:
    """The newest ``keep`` entries (ids begin with their time, so names sort by age)."""
    names = sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith("."))
    for old in names[:-keep]:
        (d / old).unlink(missing_ok=True)


class LedgerError(Exception):
    """The ledger cannot be read: one line saying which and what to do."""


def read(state_dir: str | os.PathLike[str], since: float | None = None) -> list[dict[str, Any]]:
    """Every entry kept in the state dir (from ``since`` on), oldest first. LedgerError when it cannot be read."""
    d = directory(state_dir)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith("."))
    except FileNotFoundError:
        return []
    except PermissionError:
        raise LedgerError(f"the ledger {d} is root's (it names every user's jobs): run this as root") from None
    except OSError as exc:
        raise LedgerError(f"cannot read the ledger {d}: {exc.strerror}") from None
    if since is not None:  # an id begins with its UTC time: older ones are not opened at all
        first = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(since - 1))
        names = [n for n in names if n >= first]
    out = []
    for n in names:
        try:
            fd = os.open(d / n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                entry = parse(json.loads(f.read(MAX_ENTRY + 1)[:MAX_ENTRY]))
        except PermissionError:
            raise LedgerError(f"the ledger {d} is root's (it names every user's jobs): run this as root") from None
        except (OSError, ValueError):
            continue  # removed meanwhile, or damaged: not counted
        if entry is not None and (since is None or entry["time"] >= since):
            out.append(entry)
    return out


# -- reading entries together -----------------------------------------------------------

def _gpu_key(b: dict[str, Any], node: str | None) -> str:
    """A GPU is its UUID wherever it goes; without one, its place on its node."""
    if b.get("uuid"):
        return str(b["uuid"])
    where = f"PCI {b['pci']}" if b.get("pci") else f"GPU {b['gpu']}" if b.get("gpu") is not None else "an unknown GPU"
    return f"{node or '?'}: {where}"


def score(jobs: int, users: int) -> int:
    """Grows with distinct jobs and users, never with one job's repeats: 1 for one job of one user."""
    return max(0, jobs + users - 1) if jobs else 0


def suspects(entries: Iterable[dict[str, Any]], since: float | None = None) -> dict[str, list[dict[str, Any]]]:
    """Per GPU and per node: the incidents, jobs and users that implicate it, the XIDs, the kinds of
    fault, the newest reason, and the score; most suspect first."""
    gpus: dict[str, dict[str, Any]] = {}
    nodes: dict[str, dict[str, Any]] = {}
    for e in entries:
        if since is not None and e["time"] < since:
            continue
        for b in sorted(e["blames"], key=lambda b: b["kind"] == "gpu"):  # a GPU's fault is the newest reason, if any
            node = b.get("node") or e.get("node")
            key = _gpu_key(b, node)
            g = gpus.setdefault(key, {"gpu": key, "uuid": b.get("uuid"), "serial": None, "node": node, "index": None,
                                      "pci": None, "incidents": [], "jobs": [], "users": [], "xids": [], "kinds": [],
                                      "first": e["time"], "last": e["time"], "why": ""})
            n = nodes.setdefault(node or "?", {"node": node or "?", "incidents": [], "jobs": [], "users": [], "gpus": [],
                                               "xids": [], "kinds": [], "first": e["time"], "last": e["time"], "why": ""})
            for field in ("serial", "index", "pci"):
                value = b.get("gpu" if field == "index" else field)
                if value is not None:
                    g[field] = value
            for rec in (g, n):
                _add(rec["incidents"], e["incident"])
                _add(rec["jobs"], e["job_key"])
                _add(rec["users"], e.get("user") or (f"uid {e['uid']}" if e.get("uid") is not None else "?"))
                if b.get("xid") is not None:
                    _add(rec["xids"], b["xid"])
                _add(rec["kinds"], b["kind"])
                rec["first"] = min(rec["first"], e["time"])
                if e["time"] >= rec["last"]:
                    rec["last"], rec["why"] = e["time"], b.get("why") or ""
            if e["time"] >= g["last"]:
                g["node"] = node  # where the GPU is now: the newest entry's node (a GPU moves when it is repaired)
            _add(n["gpus"], key)
    out = {"gpus": list(gpus.values()), "nodes": list(nodes.values())}
    for rows in out.values():
        for r in rows:
            r["job_names"] = [k.split(":", 1)[1].removeprefix("job ") for k in r["jobs"]]
            r["score"] = score(len(r["jobs"]), len(r["users"]))
        rows.sort(key=lambda r: (-r["score"], -r["last"]))
    return out


def _add(items: list[Any], value: Any) -> None:
    if value not in items:
        items.append(value)


def implicating_jobs(entries: Iterable[dict[str, Any]], node: str, since: float) -> dict[str, dict[str, Any]]:
    """The GPUs of ``node`` implicated since ``since``, each with the distinct jobs that implicate it."""
    found = suspects([e for e in entries if any((b.get("node") or e.get("node")) == node for b in e["blames"])], since)
    return {g["gpu"]: g for g in found["gpus"] if g["node"] == node}
