"""Reports that wait for room: a full state dir costs the dump, never the report.

When the state dir cannot take an incident (no space, SQLite's "disk I/O
error"), its report (incident.json, /proc facts, stacks, verdict) is kept in
RUNTIME_DIR/spool/ID instead, and stored and indexed by ``flush`` once the
state dir has room again (the daemon retries on a timer and at start). The
runtime dir is the daemon's own (root's, not world-writable), in RAM on most
nodes: only small files go there, never a GPU dump. Each ordinary user's reports
there are bounded (``per_uid_max`` bytes, config ``spool_bytes_per_uid``): files a
user plants in the dump dir while the disk is full must not fill RAM until
``hangwatchd run`` finds no room for its registration; past the bound a user's
report is dropped and the log says so.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import structlog

from ..host.atomic import write_atomic
from ..metrics import Metrics
from ..model import Incident
from .store import (
    Draft,
    Store,
    StoreWriteError,
    incident_to_json,
    new_id,
    write_incident_json,
)

log = structlog.get_logger("hangwatchd.spool")

SPOOL_DIR = "spool"
ROW_SUFFIX = ".row.json"  # spool/ID.row.json: what the index row will say, beside the report's directory
MAX_FILE = 4 << 20  # a spooled report keeps stacks and facts; a file bigger than this is evidence we lose
ROOM_FLOOR = 8 << 20  # below this many free bytes the state dir counts as full before anything is tried
MAX_REPORTS = 100  # reports kept in the spool (in RAM); past it the oldest is dropped, logged as spool_report_dropped


class Spool:
    def __init__(self, directory: Path, per_uid_max: int = 64 << 20) -> None:
        self.dir = Path(directory)
        self.per_uid_max = per_uid_max

    def bytes_of(self, uid: int) -> int:
        """Bytes the pending reports of ``uid`` alone hold here."""
        total = 0
        for path in self.pending():
            try:
                row = json.loads(path.with_name(path.name + ROW_SUFFIX).read_text())
            except (OSError, ValueError):
                continue
            if row.get("uids") == [uid]:
                total += _tree_bytes(path)
        return total

    def begin(self, reason: str, job: str | None, pids: list[int], now: float | None = None) -> Draft:
        now = time.time() if now is None else now
        incident_id = new_id(now)
        path = self.dir / f".partial-{incident_id}"
        path.mkdir(parents=True, mode=0o700)
        return Draft(incident_id, now, path, reason, job, tuple(pids), spooled=True)

    def take_over(self, draft: Draft) -> Draft:
        """A state-dir draft that could not be committed: its small files move here, same id."""
        path = self.dir / f".partial-{draft.id}"
        path.mkdir(parents=True, mode=0o700, exist_ok=True)
        for src in draft.path.rglob("*"):
            rel = src.relative_to(draft.path)
            if src.is_symlink() or rel.name.startswith(".incident.json"):
                continue
            if src.is_dir():
                (path / rel).mkdir(parents=True, exist_ok=True)
            elif src.is_file() and src.stat().st_size <= MAX_FILE:
                (path / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, path / rel)
        return Draft(draft.id, draft.time, path, draft.reason, draft.job, draft.pids, spooled=True)

    def keep(self, draft: Draft, data: dict[str, Any], summary: str, uids: list[int | None] | None = None) -> Path | None:
        """Seal a spooled draft: incident.json and the index row beside it, then out of .partial.
        None (and the draft removed) when it is one ordinary user's and would take that user past
        ``per_uid_max`` bytes here."""
        owners = set(uids or [])
        if len(owners) == 1:
            (uid,) = owners
            if uid:
                held, size = self.bytes_of(uid), _tree_bytes(draft.path)
                if held + size > self.per_uid_max:
                    shutil.rmtree(draft.path, ignore_errors=True)
                    log.error("incident_dropped", incident=draft.id, uid=uid,
                              why=f"the state dir is full and uid {uid}'s reports already hold {held} bytes of the "
                                  f"spool (spool_bytes_per_uid = {self.per_uid_max})")
                    return None
        write_incident_json(draft.path, data)
        row = {"id": draft.id, "time": draft.time, "host": data.get("host") or socket.gethostname(),
               "reason": draft.reason, "job": draft.job, "pids": list(draft.pids), "summary": summary,
               "complete": bool(data.get("complete", True)), "uids": list(uids or [])}
        final = self.dir / draft.id
        draft.path.replace(final)
        write_atomic(self.dir / f"{draft.id}{ROW_SUFFIX}", json.dumps(row).encode())  # last: a report is pending once its row is there
        self._prune()
        return final

    def _prune(self) -> None:
        """At most MAX_REPORTS reports wait here (they live in RAM): the oldest go first."""
        pending = self.pending()
        for old in pending[: max(0, len(pending) - MAX_REPORTS)]:
            log.error("spool_report_dropped", incident=old.name, limit=MAX_REPORTS,
                      why="the state dir has had no room for longer than the spool holds reports")
            old.with_name(old.name + ROW_SUFFIX).unlink(missing_ok=True)
            shutil.rmtree(old, ignore_errors=True)

    def pending(self) -> list[Path]:
        """Sealed reports waiting for the state dir, oldest first."""
        try:
            return sorted(p for p in self.dir.iterdir() if not p.name.startswith(".") and p.is_dir()
                          and p.with_name(p.name + ROW_SUFFIX).is_file())
        except FileNotFoundError:
            return []

    def find(self, incident_id: str) -> Path | None:
        matches = [p for p in self.pending() if p.name.startswith(incident_id)]
        return matches[0] if len(matches) == 1 else None

    def flush(self, store: Store) -> list[str]:
        """Store and index every pending report the state dir takes now; stop at the first it refuses."""
        done = []
        for path in self.pending():
            row_file = path.with_name(path.name + ROW_SUFFIX)
            row = json.loads(row_file.read_text())
            try:
                store.adopt(path, row)
            except StoreWriteError:
                break
            row_file.unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
            done.append(row["id"])
        return done

    def clear_partials(self) -> None:
        """Drafts a stopped daemon left unsealed: their capture never finished, nothing refers to them."""
        for stray in self.dir.glob(".partial-*"):
            shutil.rmtree(stray, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def has_room(state_dir: Path) -> bool:
    """Whether the state dir has room for an incident's report, before anything is written there."""
    try:
        st = os.statvfs(state_dir)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= ROOM_FLOOR


def begin_draft(store: Store, spool: Spool | None, reason: str, job: str | None, pids: list[int],
                metrics: Metrics | None = None) -> Draft:
    """A draft in the state dir, or in the spool when the state dir has no room (or refuses the write)."""
    if spool is not None and not has_room(store.root):
        _count_failure(metrics, f"less than {ROOM_FLOOR >> 20} MiB free in {store.root}")
        return spool.begin(reason, job, pids)
    try:
        return store.begin(reason, job, pids)
    except StoreWriteError as exc:
        if spool is None:
            raise
        _count_failure(metrics, str(exc))
        return spool.begin(reason, job, pids)


def finish_draft(store: Store, spool: Spool | None, draft: Draft, incident: Incident, summary: str,
                 analysis: dict[str, Any] | None = None, metrics: Metrics | None = None) -> None:
    """Commit a draft to the store, or seal it in the spool when the store cannot take it."""
    if not draft.spooled:
        try:
            store.commit(draft, incident, summary, analysis)
            return
        except StoreWriteError as exc:
            if spool is None:
                raise
            _count_failure(metrics, str(exc))
            spooled = spool.take_over(draft)
            store.abandon(draft)  # frees the room the draft held
            draft = spooled
    assert spool is not None
    data = incident_to_json(incident)
    if analysis is not None:
        data["analysis"] = analysis
    if spool.keep(draft, data, summary, [pc.registration.uid for pc in incident.processes]) is None:
        return
    log.error("incident_spooled", incident=draft.id, spool=str(spool.dir),
              why="the state dir has no room; stored once it has")


def _count_failure(metrics: Metrics | None, why: str) -> None:
    log.error("store_write_failed", error=why)
    if metrics is not None:
        metrics.store_write_failures.labels(**metrics.labels()).inc()
