"""Incidents on disk: one directory each under STATE_DIR/incidents, indexed in SQLite.

An incident is assembled in ``incidents/.partial-ID`` and renamed into place
only once ``incident.json`` is written, then marked complete in the index:
nothing half-written is ever listed as complete. A crash in between is found
at the next start (``recover``): a draft with its incident.json is finished,
one without is kept and marked incomplete.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from ..host.atomic import write_atomic
from ..model import Incident
from . import permissions

log = structlog.get_logger("hangwatchd.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY,
    time REAL NOT NULL,
    host TEXT NOT NULL,
    reason TEXT NOT NULL,
    job TEXT,
    status TEXT NOT NULL,          -- capturing | complete | incomplete
    processes TEXT NOT NULL,       -- JSON list of pids
    summary TEXT
);
CREATE INDEX IF NOT EXISTS incidents_time ON incidents(time);
CREATE TABLE IF NOT EXISTS ingested (   -- exception dumps already made into incidents, across restarts
    name TEXT PRIMARY KEY,
    time REAL NOT NULL
);
"""


class StoreError(Exception):
    """The state dir cannot be used: the message says which and what to do."""


class StoreWriteError(StoreError):
    """Writing an incident failed (a full disk, most often): the caller keeps the report elsewhere."""


def _write_failure(root: Path, exc: BaseException) -> StoreWriteError:
    return StoreWriteError(f"cannot write to the state dir {root} ({exc}); is it full? (df {root})")


@dataclass(frozen=True)
class Draft:
    id: str
    time: float
    path: Path
    reason: str = ""
    job: str | None = None
    pids: tuple[int, ...] = ()
    spooled: bool = False  # assembled in the runtime dir's spool: the state dir had no room


def _allocated(path: str | os.PathLike[str]) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0


def new_id(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def write_incident_json(directory: Path, data: dict[str, Any]) -> None:
    """incident.json, written whole or not at all."""
    write_atomic(directory / "incident.json", json.dumps(data, indent=2, default=str).encode(), fsync=True)


def incident_to_json(incident: Incident) -> dict[str, Any]:
    data = asdict(incident)
    data["processes"] = []
    for pc in incident.processes:
        r = pc.registration
        data["processes"].append({
            "pid": r.process.pid, "start_time": r.process.start_time, "job": r.job, "rank": r.rank,
            "local_rank": r.local_rank, "world_size": r.world_size, "cmdline": list(r.cmdline),
            "dir": str(r.process.pid),
            "steps": [asdict(s) for s in pc.steps],
        })
    return data


def _add_pending_column(db: sqlite3.Connection) -> None:
    """Indexes made before evidence could be added to a stored incident get the column it needs."""
    columns = {r[1] for r in db.execute("PRAGMA table_info(incidents)")}
    if "pending" not in columns:
        db.execute("ALTER TABLE incidents ADD COLUMN pending INTEGER NOT NULL DEFAULT 0")


COMING = "; still coming: "  # what an index row's summary says while evidence is pending, before the list
LATE_DIR = ".late-"  # incidents/.late-ID-PID-STEP: where a step still running after the store writes, unseen


class Store:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.root = Path(state_dir)
        self.dir = self.root / "incidents"
        self.index = self.root / "index.sqlite"

    def open(self) -> str | None:
        """Create the layout (or check it is usable) and the index.

        A state dir that is only full (its index there and readable) is usable: what
        cannot be written waits in the spool. Returns a warning to log then, else None."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with self._db() as db:
                db.executescript(SCHEMA)
                _add_pending_column(db)
        except (OSError, sqlite3.Error) as exc:
            if self._readable() and os.access(self.dir, os.W_OK):
                return f"state dir {self.root} cannot be written now ({exc}); reports wait in the spool until it can"
            raise StoreError(f"state dir {self.root} is not usable ({exc}); pass --state-dir with a writable directory") from None
        if not os.access(self.dir, os.W_OK):
            raise StoreError(f"state dir {self.root} is not writable; pass --state-dir with a writable directory")
        return None

    def _readable(self) -> bool:
        """An index is there (its header says SQLite): a state dir that fails only for want of room."""
        try:
            with open(self.index, "rb") as f:
                return f.read(16) == b"SQLite format 3\0"
        except OSError:
            return False

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.index, timeout=10, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            yield db
        finally:
            db.close()

    @contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        """The index for reading, also where it cannot be written: by a user who may not write
        the state dir (``hangwatchd incidents`` as the owner of an incident), or on a full disk.
        Read-only, and where SQLite cannot make its shared-memory file, an immutable snapshot."""
        db: sqlite3.Connection | None = None
        if os.access(self.root, os.W_OK):
            db = sqlite3.connect(self.index, timeout=10, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
            except sqlite3.OperationalError:
                db.close()
                db = None
        if db is None:
            uri = self.index.absolute().as_uri()
            db = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=10)
            try:
                db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            except sqlite3.OperationalError:  # no -shm to share (the daemon is between writes): a snapshot
                db.close()
                db = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=10)
        try:
            yield db
        finally:
            db.close()

    # -- writing ---------------------------------------------------------

    def begin(self, reason: str, job: str | None, pids: list[int], now: float | None = None) -> Draft:
        """A new draft in the state dir, indexed as 'capturing'; StoreWriteError when it cannot be written."""
        now = time.time() if now is None else now
        incident_id = new_id(now)
        draft = Draft(incident_id, now, self.dir / f".partial-{incident_id}", reason, job, tuple(pids))
        try:
            draft.path.mkdir(parents=True, mode=0o700)  # root's alone until commit opens it to its owner
            with self._db() as db:
                db.execute(
                    "INSERT INTO incidents (id, time, host, reason, job, status, processes) VALUES (?,?,?,?,?,?,?)",
                    (draft.id, now, socket.gethostname(), reason, job, "capturing", json.dumps(pids)),
                )
        except (OSError, sqlite3.Error) as exc:
            shutil.rmtree(draft.path, ignore_errors=True)
            raise _write_failure(self.root, exc) from exc
        return draft

    def commit(self, draft: Draft, incident: Incident, summary: str, analysis: dict[str, Any] | None = None) -> Path:
        """Write incident.json, move the directory into place, mark it complete.

        StoreWriteError when the state dir cannot take it; the draft is then left as it is."""
        data = incident_to_json(incident)
        if analysis is not None:
            data["analysis"] = analysis
        try:
            write_incident_json(draft.path, data)
            permissions.restrict(draft.path, [pc.registration.uid for pc in incident.processes])
            final = self.dir / draft.id
            draft.path.replace(final)
            self._fsync_dir(self.dir)
        except OSError as exc:
            raise _write_failure(self.root, exc) from exc
        try:
            with self._db() as db:
                db.execute("UPDATE incidents SET status=?, summary=?, pending=? WHERE id=?",
                           ("complete" if incident.complete else "incomplete", summary, len(incident.pending), draft.id))
        except sqlite3.Error as exc:
            final.replace(draft.path)  # not indexed: back to a draft, for the caller to keep elsewhere
            raise _write_failure(self.root, exc) from exc
        return final

    # -- adding to a stored incident (evidence that came after it was stored) --

    def late_dir(self, incident_id: str, pid: int, step: str) -> Path:
        """Where a step still running for ``pid`` writes: beside the incident (the same filesystem, so
        a file moves in by one rename), hidden, root's alone, one a step. Nothing there is shown or
        analysed; ``add_files`` moves each finished file into place."""
        path = self.dir / f"{LATE_DIR}{incident_id}-{pid}-{step}"
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def add_files(self, incident_id: str, pid: int, late: Path, uids: list[int | None], more: bool = False) -> list[str]:
        """Move the finished files of ``late`` (a ``late_dir``) into the incident's PID directory,
        each by one rename: a reader sees a file whole or not at all. Returns their names.
        ``more``: the step is still writing there (only its finished files are in ``late`` now)."""
        target = self.dir / incident_id / str(pid)
        try:
            target.mkdir(mode=0o700, exist_ok=True)
            permissions.restrict(late, uids)  # opened to the owner before it is visible, as commit does
            moved = []
            for entry in sorted(os.scandir(late), key=lambda e: e.name):
                if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                    continue  # a temp file of a step that gave up: never shown
                os.replace(entry.path, target / entry.name)
                moved.append(entry.name)
            self._fsync_dir(target)
            if not more:
                shutil.rmtree(late, ignore_errors=True)
        except OSError as exc:
            raise _write_failure(self.root, exc) from exc
        return moved

    def amend(self, incident_id: str, incident: Incident, summary: str, analysis: dict[str, Any] | None = None) -> None:
        """Rewrite a stored incident's incident.json (whole or not at all) and its index row: evidence
        came, or passed its deadline. StoreWriteError when the state dir cannot take it; the
        incident as it was stays whole."""
        data = incident_to_json(incident)
        if analysis is not None:
            data["analysis"] = analysis
        final = self.dir / incident_id
        try:
            write_incident_json(final, data)
            # incident.json and the pages are new files: closed and opened to the owner as at commit.
            permissions.restrict(final, [pc.registration.uid for pc in incident.processes])
            with self._db() as db:
                db.execute("UPDATE incidents SET summary=?, pending=? WHERE id=?", (summary, len(incident.pending), incident_id))
        except (OSError, sqlite3.Error) as exc:
            raise _write_failure(self.root, exc) from exc

    def abandon(self, draft: Draft) -> None:
        """Drop a draft whose report went elsewhere: its directory, and its index row where the index takes it."""
        shutil.rmtree(draft.path, ignore_errors=True)
        try:
            with self._db() as db:
                db.execute("DELETE FROM incidents WHERE id=? AND status='capturing'", (draft.id,))
        except sqlite3.Error:
            pass  # a row left 'capturing' is never listed; adopt() or recover() settles it

    def adopt(self, src: Path, row: dict[str, Any]) -> Path:
        """Store a report assembled elsewhere (the spool): copy it in, then index it, all or nothing."""
        incident_id = row["id"]
        partial = self.dir / f".partial-{incident_id}"
        final = self.dir / incident_id
        try:
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(src, partial, symlinks=True)
            permissions.restrict(partial, row.get("uids") or [])
            partial.replace(final)
            self._fsync_dir(self.dir)
            with self._db() as db:
                db.execute(
                    "INSERT OR REPLACE INTO incidents (id, time, host, reason, job, status, processes, summary) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    (incident_id, row["time"], row.get("host") or socket.gethostname(), row["reason"], row.get("job"),
                     "complete" if row.get("complete", True) else "incomplete", json.dumps(row.get("pids") or []),
                     row.get("summary")))
        except (OSError, sqlite3.Error) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if final.exists() and not self._indexed(incident_id):
                shutil.rmtree(final, ignore_errors=True)
            raise _write_failure(self.root, exc) from exc
        return final

    def _indexed(self, incident_id: str) -> bool:
        try:
            with self._db() as db:
                return db.execute("SELECT 1 FROM incidents WHERE id=? AND status != 'capturing'",
                                  (incident_id,)).fetchone() is not None
        except sqlite3.Error:
            return False

    # -- exception dumps already ingested (remembered across restarts) ----

    def ingested(self) -> set[str]:
        try:
            with self._db() as db:
                return {r[0] for r in db.execute("SELECT name FROM ingested").fetchall()}
        except sqlite3.Error:
            return set()

    def mark_ingested(self, name: str) -> None:
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO ingested (name, time) VALUES (?, ?)", (name, time.time()))

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def recover(self) -> list[str]:
        """Finish or mark incomplete what a crash left half-done; return the ids touched.

        StoreWriteError when the state dir cannot be written (full): the rest waits for the next start."""
        try:
            return self._recover()
        except (OSError, sqlite3.Error) as exc:
            raise _write_failure(self.root, exc) from exc

    def _recover(self) -> list[str]:
        touched = []
        with self._db() as db:
            rows = db.execute("SELECT id FROM incidents WHERE status='capturing'").fetchall()
        for (incident_id,) in rows:
            partial = self.dir / f".partial-{incident_id}"
            final = self.dir / incident_id
            status = "incomplete"
            if (partial / "incident.json").exists():
                partial.replace(final)
                status = "complete"
            elif partial.exists():
                meta = {"id": incident_id, "complete": False,
                        "note": "the daemon stopped while capturing this incident; what it had captured is kept"}
                (partial / "incident.json").write_text(json.dumps(meta, indent=2))
                partial.replace(final)
            elif final.exists():
                status = "complete"
            with self._db() as db:
                db.execute("UPDATE incidents SET status=?, summary=COALESCE(summary, ?) WHERE id=?",
                           (status, "interrupted by a daemon restart" if status == "incomplete" else None, incident_id))
            touched.append(incident_id)
        for late in self.dir.glob(f"{LATE_DIR}*"):
            shutil.rmtree(late, ignore_errors=True)  # a step the stop cut short: what it wrote was never shown
        with self._db() as db:
            stopped = [r[0] for r in db.execute("SELECT id FROM incidents WHERE pending > 0").fetchall()]
        for incident_id in stopped:
            self._never_came(incident_id, "the daemon stopped before it came")
            touched.append(incident_id)
        for stray in self.dir.glob(".partial-*"):
            if not (self.dir / stray.name.removeprefix(".partial-")).exists():
                shutil.rmtree(stray, ignore_errors=True)  # never indexed: nothing refers to it
        return touched

    def _never_came(self, incident_id: str, why: str) -> None:
        """Evidence a stopped daemon was still waiting for: said so in incident.json, the row settled."""
        path = self.dir / incident_id / "incident.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict) and data.get("pending"):
            for p in data["pending"]:
                proc = next((x for x in data.get("processes", []) if x.get("pid") == p.get("pid")), None)
                if proc is not None:
                    proc.setdefault("steps", []).append(
                        {"step": p.get("step"), "ok": False, "seconds": 0.0, "error": f"never came: {why}",
                         "files": [], "skipped": False, "not_applicable": False})
            data["pending"] = []
            write_incident_json(path.parent, data)
        with self._db() as db:
            row = db.execute("SELECT summary FROM incidents WHERE id=?", (incident_id,)).fetchone()
            summary = (row[0] or "").split(COMING)[0] if row else None
            db.execute("UPDATE incidents SET pending=0, summary=? WHERE id=?", (summary, incident_id))

    # -- retention -------------------------------------------------------

    def enforce_retention(self, max_bytes: float, dump_max_age: float, incident_max_age: float,
                          now: float | None = None) -> list[str]:
        """Bound the state dir: raw dumps go first (past their age, then oldest first while
        over the size), then whole incidents (past their age, then oldest first). The index
        and the reports outlive the dumps. Returns what was removed, for the log."""
        now = time.time() if now is None else now
        removed: list[str] = []
        done = [i for i in self.list(limit=1_000_000)]
        done.sort(key=lambda i: i["time"])  # oldest first
        dumps = [(i, p) for i in done for p in Path(i["dir"]).glob("*/coredump.nvcudmp*")]
        for inc, dump in dumps:
            if now - inc["time"] > dump_max_age:
                removed.append(self._drop_dump(dump))
        for _inc, dump in dumps:
            if self._size() <= max_bytes:
                break
            if dump.exists():
                removed.append(self._drop_dump(dump))
        for inc in done:
            if now - inc["time"] > incident_max_age or self._size() > max_bytes:
                shutil.rmtree(inc["dir"], ignore_errors=True)
                with self._db() as db:
                    db.execute("DELETE FROM incidents WHERE id=?", (inc["id"],))
                removed.append(inc["dir"])
        return removed

    def _drop_dump(self, dump: Path) -> str:
        dump.unlink(missing_ok=True)
        note = dump.parent / "cuda_dump-notes.txt"
        with open(note, "a") as f:
            f.write("the raw dump was removed by retention; symbolized.json keeps what it said\n")
        return str(dump)

    def _size(self) -> int:
        """Bytes on disk of what the store owns: its incidents (root's, 0700) and its index.

        Never the state dir as a whole (a world-writable dump dir there would count a user's
        files), and allocated blocks, not apparent sizes (a sparse file costs what it uses)."""
        total = 0
        for path in (self.index, self.index.with_name(self.index.name + "-wal")):
            total += _allocated(path)
        for root, _dirs, files in os.walk(self.dir):  # links are not followed
            for name in files:
                total += _allocated(os.path.join(root, name))
        return total

    # -- reading ---------------------------------------------------------

    def list(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Incidents newest first; never one still being captured. StoreError when the index cannot be read."""
        if not self.index.exists():
            return []
        try:
            with self._reader() as db:
                # An index no daemon of this version has opened yet has no pending column: none is pending.
                pending = "pending" if any(r[1] == "pending" for r in db.execute("PRAGMA table_info(incidents)")) else "0"
                rows = db.execute(
                    f"SELECT id, time, host, reason, job, status, processes, summary, {pending} FROM incidents "
                    "WHERE status != 'capturing' ORDER BY time DESC, id DESC LIMIT ?", (limit,)).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the incident index {self.index} ({exc}); "
                             f"if the disk is full, free space there (df {self.root})") from None
        return [
            {"id": r[0], "time": r[1], "host": r[2], "reason": r[3], "job": r[4], "complete": r[5] == "complete",
             "processes": json.loads(r[6]), "summary": r[7], "pending": r[8] or 0, "dir": str(self.dir / r[0])}
            for r in rows
            # A user sees the incidents they may open (their own): see incident_access.
            if os.geteuid() == 0 or os.access(self.dir / r[0], os.R_OK | os.X_OK)
        ]

    def path_of(self, incident_id: str) -> Path | None:
        """The directory of a listed incident, by id or unique prefix."""
        if "/" in incident_id or incident_id.startswith("."):
            return None
        matches = [i["id"] for i in self.list() if i["id"].startswith(incident_id)]
        if len(matches) != 1:
            return None
        return self.dir / matches[0]
