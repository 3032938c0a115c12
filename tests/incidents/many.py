"""Many stored incidents, made cheaply: a directory each, as the daemon leaves one (incident.json,
a process directory with its facts and, if asked, a raw GPU dump), and their index rows in one
transaction. For the tests and bench/incidents_scale.py; real files and real SQLite throughout."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

from hangwatchd.incidents.store import Store

PID = 4242


def incident_id(when: float, n: int) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when)) + f"-{n:06x}"


def fill(state_dir: Path, count: int, newest: float | None = None, every: float = 60.0,
         jobs: Sequence[str] = ("train",), dump_bytes: int = 0, file_bytes: int = 2000) -> list[str]:
    """``count`` complete incidents in ``state_dir``, ``every`` seconds apart, the newest at ``newest``
    (default: now), jobs taken in turn from ``jobs``; their ids, oldest first."""
    store = Store(state_dir)
    store.open()
    newest = time.time() if newest is None else newest
    rows, ids = [], []
    filler = b"x" * file_bytes
    for n in range(count):
        when = newest - (count - 1 - n) * every
        iid = incident_id(when, n)
        job = jobs[n % len(jobs)]
        path = store.dir / iid
        (path / str(PID)).mkdir(parents=True)
        data = {"id": iid, "time": when, "host": "node-1", "reason": "heartbeat", "detail": "no beat for 120 s",
                "verdict": f"pid {PID}: blocked in hang_here", "job": job, "complete": True, "pending": [],
                "processes": [{"pid": PID, "job": job, "steps": []}]}
        (path / "incident.json").write_text(json.dumps(data))
        (path / str(PID) / "proc.json").write_bytes(filler)
        if dump_bytes:
            (path / str(PID) / "coredump.nvcudmp.zst").write_bytes(os.urandom(dump_bytes))
        rows.append((iid, when, "node-1", "heartbeat", job, "complete", json.dumps([PID]),
                     f"pid {PID}: blocked in hang_here (no beat for 120 s)"))
        ids.append(iid)
    db = sqlite3.connect(store.index, isolation_level=None)
    try:
        db.execute("BEGIN")
        db.executemany("INSERT INTO incidents (id, time, host, reason, job, status, processes, summary) "
                       "VALUES (?,?,?,?,?,?,?,?)", rows)
        db.execute("COMMIT")
    finally:
        db.close()
    return ids
