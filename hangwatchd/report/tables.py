"""The CLI's tables: watched processes (``status``), incidents and job incidents (``incidents``), suspects.

Columns are cut to a width with '…', so nobody reads '3' for '30'; ``--json``
has every value whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .names import fold
from .terminal import clean


def cut(text: str, width: int) -> str:
    """At most ``width`` characters; a cut one ends in '…' so nobody reads '3' for '30'."""
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def table(rows: Sequence[tuple[str, ...]]) -> str:
    """Rows (the first is the header) in columns as wide as their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n" for r in rows)


def _utc(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(when))


def status(status: dict[str, Any]) -> str:
    """``hangwatchd status``: the daemon, then one row per watched process."""
    status = clean(status)  # job names, cmdlines and STATUS= are the users'
    d = status["daemon"]
    out = (f"hangwatchd {d.get('version')} pid {d.get('pid')}, metrics on {d.get('metrics_address') or 'none'}, "
           f"state dir {d.get('state_dir')}\n")
    rows = [("PID", "JOB", "RANK", "STATE", "LAST BEAT", "TIMEOUT", "INCIDENT", "COMMAND")]
    for p in status["processes"]:
        age = p.get("last_beat_age")
        rows.append((
            str(p["pid"]), cut(p.get("job") or "-", 32),
            "launcher" if p.get("role") == "launcher" else str(p["rank"]) if p.get("rank") is not None else "-", p["state"],
            f"{age:.1f}s ago" if age is not None else "never",
            _timeout(p), p.get("incident") or "-",
            cut(" ".join(p.get("cmdline") or []), 60),
        ))
    out += table(rows)
    if len(rows) == 1:
        out += "(no process is watched)\n"
    return out


def _timeout(p: dict[str, Any]) -> str:
    """The timeout that decides this process's hang (stack or heartbeat) and where it comes from."""
    seconds, source = p.get("applied_timeout") or (p["timeout"], p.get("timeout_source", "config"))
    return f"{seconds:.3g}s ({source})"


def incidents(items: Sequence[dict[str, Any]]) -> str:
    """``hangwatchd incidents``: one row per stored incident, newest first."""
    items = clean(items)  # summaries carry job names, symbol names and STATUS= text
    rows = [("ID", "TIME (UTC)", "REASON", "JOB", "PIDS", "SUMMARY")]
    for i in items:
        rows.append((i["id"] + ("" if i["complete"] else " (incomplete)") + (" (evidence coming)" if i.get("pending") else ""),
                     _utc(i["time"]), i["reason"], cut(i["job"] or "-", 32),
                     cut(",".join(map(str, i["processes"])), 24), cut(fold(i["summary"] or ""), 100)))
    return table(rows)


def job_incidents(items: Sequence[dict[str, Any]]) -> str:
    """``hangwatchd incidents --store``: one row per job incident in the shared store."""
    items = clean(items)  # any node writes the store
    rows = [("JOB INCIDENT", "TIME (UTC)", "JOB", "NODES", "RANKS", "REASON")]
    for i in items:
        rows.append((i["job_incident"], _utc(i["time"]), i["job"],
                     ",".join(i["nodes"]), ",".join(map(str, i["ranks"])) or "-", i["reason"] or "-"))
    return table(rows)


def suspects(found: dict[str, Any]) -> str:
    """``hangwatchd suspects``: the GPUs, then the nodes, most suspect first (the ledger's score)."""
    found = clean(found)  # job names, users and node names: any user's, any node's
    out = ""
    if found["gpus"]:
        rows: list[tuple[str, ...]] = [("SCORE", "GPU", "SERIAL", "NODE", "INCIDENTS", "JOBS", "USERS", "XIDS", "LAST (UTC)", "WHY (THE NEWEST)")]
        for g in found["gpus"]:
            where = f"GPU {g['index']}" if g.get("index") is not None else ""
            rows.append((str(g["score"]), cut(g["gpu"], 44) + (f" ({where})" if where and g.get("uuid") else ""),
                         g.get("serial") or "-", cut(g.get("node") or "?", 24), str(len(g["incidents"])),
                         cut(", ".join(g["job_names"]), 40), cut(", ".join(g["users"]), 24),
                         ",".join(map(str, g["xids"])) or "lost", _utc(g["last"]), cut(fold(g.get("why") or ""), 80)))
        out += "GPUs\n" + table(rows)
    if found["nodes"]:
        node_rows: list[tuple[str, ...]] = [("SCORE", "NODE", "GPUS", "INCIDENTS", "JOBS", "USERS", "XIDS", "LAST (UTC)")]
        for n in found["nodes"]:
            node_rows.append((str(n["score"]), cut(n["node"], 32), str(len(n["gpus"])), str(len(n["incidents"])),
                         cut(", ".join(n["job_names"]), 40), cut(", ".join(n["users"]), 24),
                         ",".join(map(str, n["xids"])) or "lost", _utc(n["last"])))
        out += ("\n" if out else "") + "Nodes\n" + table(node_rows)
    return out + "\nScore: different jobs + different users - 1; one job failing again and again scores 1.\n"
