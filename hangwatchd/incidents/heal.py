"""The index made whole again as the daemon starts: the incident directories are the truth.

An index SQLite calls corrupt (or that fails its quick check) is moved aside, kept as
``index.sqlite.corrupt-TIME`` (its write-ahead log beside it), and a new one is made.
Then the index is made to match the directories, at every start: each complete incident
directory it lacks is indexed from its ``incident.json``, each row whose directory is gone
is dropped. A corrupt, lost or deleted index is thus rebuilt whole, and the daemon never
refuses to watch because of it. Each rebuild is logged and counted
(``hangwatchd_index_rebuilds_total{reason}``: corrupt, missing).

It runs under the state dir's lock (one daemon per state dir), before anything is captured.
"""

from __future__ import annotations

import calendar
import json
import os
import socket
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ..metrics import Metrics
from .index import corrupt
from .store import Store, write_incident_json

log = structlog.get_logger("hangwatchd.store")

PARTIAL = ".partial-"
ASIDE = ".corrupt-"  # index.sqlite.corrupt-20261201T203000Z: a corrupt index, kept for whoever wants to look
BATCH = 500  # rows written per transaction while rebuilding


@dataclass(frozen=True)
class Healed:
    moved_aside: Path | None  # where a corrupt index went
    why: str | None  # what SQLite said of it
    indexed: int  # incident directories the index lacked, indexed from their incident.json
    dropped: int  # index rows whose directory was gone


def open_healed(store: Store, metrics: Metrics | None = None, stopping: Callable[[], bool] = lambda: False) -> str | None:
    """``store.open()`` with its index checked first and made to match the directories after;
    returns open()'s warning (a full state dir), raises its StoreError (an unusable one)."""
    had_index = store.index.exists()
    why = damage(store.index)
    aside = None
    if why:
        try:
            aside = set_aside(store.index)
        except OSError as exc:  # open() then says so, and reports wait in the spool: the watching goes on
            log.error("index_corrupt", index=str(store.index), error=why, action=f"not moved aside ({exc})")
            return store.open()
        log.error("index_corrupt", index=str(store.index), error=why, kept=str(aside),
                  action="rebuilding it from the incident directories")
    warning = store.open()
    if warning:
        return warning  # a full disk: what can be indexed waits for the next start
    started = time.monotonic()
    try:
        healed = reconcile(store, stopping)
    except (OSError, sqlite3.Error) as exc:
        log.error("index_not_rebuilt", index=str(store.index), error=str(exc), action="tried again at the next start")
        return None
    healed = Healed(aside, why, healed.indexed, healed.dropped)
    rebuilt = "corrupt" if why else "missing" if not had_index and healed.indexed else None
    if rebuilt or healed.indexed or healed.dropped:
        log.warning("index_rebuilt" if rebuilt else "index_reconciled", index=str(store.index), reason=rebuilt,
                    indexed=healed.indexed, dropped=healed.dropped, seconds=round(time.monotonic() - started, 3))
    if rebuilt and metrics is not None:
        metrics.index_rebuilds.labels(**metrics.labels(reason=rebuilt)).inc()
    return None


def damage(index: Path) -> str | None:
    """What is wrong with the index file, where SQLite says it is damaged; None where it is
    fine, absent, or unreadable for another reason (a full disk, no permission)."""
    if not index.exists():
        return None
    try:
        db = sqlite3.connect(index, timeout=10)
        try:
            (verdict,) = db.execute("PRAGMA quick_check").fetchone()
        finally:
            db.close()
    except sqlite3.Error as exc:
        return str(exc) if corrupt(exc) else None
    return None if verdict == "ok" else f"quick_check: {verdict}"


def set_aside(index: Path) -> Path:
    """Move the index (and its write-ahead log) aside, kept under a name with the time; drop
    its shared-memory file (SQLite remakes it). Returns where the index went."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = index.with_name(f"{index.name}{ASIDE}{stamp}")
    os.rename(index, aside)
    wal = index.with_name(index.name + "-wal")
    if wal.exists():
        os.rename(wal, aside.with_name(aside.name + "-wal"))
    index.with_name(index.name + "-shm").unlink(missing_ok=True)
    return aside


def reconcile(store: Store, stopping: Callable[[], bool] = lambda: False) -> Healed:
    """Index each incident directory the index lacks, drop each row whose directory is gone."""
    db = sqlite3.connect(store.index, timeout=10, isolation_level=None)
    try:
        rows = dict(db.execute("SELECT id, status FROM incidents").fetchall())
        try:
            names = os.listdir(store.dir)
        except FileNotFoundError:
            names = []
        on_disk = {n for n in names if not n.startswith(".")}
        indexed = 0
        batch: list[tuple[Any, ...]] = []
        for name in sorted(names):
            if stopping():
                break  # the rest at the next start
            if name.startswith(PARTIAL):
                finished = _finish_draft(store, name, rows)
                if finished is None:
                    continue
                name = finished
                on_disk.add(name)
            elif name.startswith(".") or name in rows or not (store.dir / name).is_dir():
                continue
            batch.append(_row(store.dir / name))
            if len(batch) >= BATCH:
                indexed += _insert(db, batch)
        indexed += _insert(db, batch)
        gone = [i for i, status in rows.items() if i not in on_disk and status != "capturing"]
        if gone and not stopping():
            db.execute("BEGIN")
            db.executemany("DELETE FROM incidents WHERE id=?", [(i,) for i in gone])
            db.execute("COMMIT")
        else:
            gone = []
    finally:
        db.close()
    return Healed(None, None, indexed, len(gone))


def _insert(db: sqlite3.Connection, batch: list[tuple[Any, ...]]) -> int:
    if not batch:
        return 0
    db.execute("BEGIN")
    db.executemany("INSERT OR IGNORE INTO incidents (id, time, host, reason, job, status, processes, summary, pending) "
                   "VALUES (?,?,?,?,?,?,?,?,?)", batch)
    db.execute("COMMIT")
    n = len(batch)
    batch.clear()
    return n


def _finish_draft(store: Store, name: str, rows: dict[str, str]) -> str | None:
    """A draft the index has no row of (it was lost with the index): made an incident, as
    ``Store.recover`` does with one whose row says capturing; the incident's name, or None
    where there is nothing to keep (an empty draft, one of a known row, one already stored)."""
    incident_id = name.removeprefix(PARTIAL)
    partial, final = store.dir / name, store.dir / incident_id
    if incident_id in rows or final.exists() or not partial.is_dir():
        return None
    if not (partial / "incident.json").exists():
        if not any(os.scandir(partial)):
            return None
        write_incident_json(partial, {"id": incident_id, "complete": False,
                                      "note": "the daemon stopped while capturing this incident; what it had captured is kept"})
    partial.replace(final)
    return incident_id


def _row(path: Path) -> tuple[Any, ...]:
    """An index row from an incident directory: its incident.json says what it is."""
    try:
        data = json.loads((path / "incident.json").read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        data = {"complete": False, "detail": "its incident.json is missing or unreadable"}
    when = data.get("time")
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        when = _time_of(path)
    pids = [p.get("pid") for p in data.get("processes") or [] if isinstance(p, dict) and isinstance(p.get("pid"), int)]
    reason = str(data.get("reason") or "unknown")
    detail = str(data.get("detail") or "")
    verdict = data.get("verdict")
    if data.get("note") and not verdict:
        summary = "interrupted by a daemon restart"
    elif reason == "gpu-exception":
        summary = f"gpu-exception: {detail}"
    else:
        summary = f"{verdict} ({detail})" if verdict else detail
    return (path.name, float(when), str(data.get("host") or socket.gethostname()), reason,
            data.get("job") if isinstance(data.get("job"), str) else None,
            "complete" if data.get("complete", True) is True else "incomplete", json.dumps(pids), summary,
            len(data.get("pending") or []))


def _time_of(path: Path) -> float:
    """When an incident happened, by its id (20261201T203000Z-abc123), else its directory's time."""
    try:
        return float(calendar.timegm(time.strptime(path.name[:16], "%Y%m%dT%H%M%SZ")))
    except ValueError:
        return path.stat().st_mtime
