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
import shutil
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..host.atomic import write_atomic
from ..model import ProcessId
from . import ledger, permissions
from .index import INCIDENTS, INDEX, REBUILT_AT_START, SCHEMA, Index, Page, StoreError, corrupt, unreadable

if TYPE_CHECKING:
    from ..model import Incident

__all__ = ["COMING", "LATE_DIR", "REMOVING", "Draft", "Store", "StoreError", "StoreWriteError", "new_id"]


ADOPT_MAX = 1000  # newest incidents a restarted daemon looks through for processes it captured
MAX_INCIDENT_JSON = 16 << 20


class StoreWriteError(StoreError):
    """Writing an incident failed (a full disk, most often): the caller keeps the report elsewhere."""


def _write_failure(root: Path, exc: BaseException) -> StoreWriteError:
    if isinstance(exc, sqlite3.Error) and corrupt(exc):
        return StoreWriteError(f"the incident index {root / INDEX} is corrupt ({exc}); {REBUILT_AT_START}")
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


def new_id(now: float) -> str:
    import secrets  # here: the commands that only read the store never make an id

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
            "pid": r.process.pid, "start_time": r.process.start_time, "uid": r.uid, "job": r.job, "rank": r.rank,
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
REMOVING = ".removing-"  # incidents/.removing-ID: an incident retention is deleting, out of the index already


def late_owner(name: str) -> str:
    """The incident a late dir's name (``.late-ID-PID-STEP``) belongs to."""
    return name.removeprefix(LATE_DIR).rsplit("-", 2)[0]


class Store:
    def __init__(self, state_dir: str | os.PathLike[str], on_stored: Callable[[str], None] | None = None,
                 on_ledger: Callable[[str, dict[str, Any] | None], None] | None = None) -> None:
        """``on_stored(id)``: files were stored into incident ``id`` (it was committed, adopted from
        the spool, or given late evidence); ``on_ledger(id, entry)``: the incident's ledger entry was
        written (None: its verdict blames no GPU, or no longer); each called on the thread that stored it."""
        self.root = Path(state_dir)
        self.dir = self.root / INCIDENTS
        self.index = self.root / INDEX
        self.on_stored = on_stored
        self.on_ledger = on_ledger

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
            if isinstance(exc, sqlite3.Error) and corrupt(exc) and os.access(self.dir, os.W_OK):
                # Moved aside and rebuilt at start (heal); one that went bad since must not stop the watching.
                return f"the incident index {self.index} is corrupt ({exc}); reports wait in the spool until a restart rebuilds it"
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
        self._ledger(data)
        self._stored(draft.id)
        return final

    def _ledger(self, data: dict[str, Any]) -> None:
        """The incident's entry in the ledger of suspects, kept as its record is (``ledger.py``)."""
        try:
            entry = ledger.write(self.root, data)
        except OSError:
            return  # a full disk costs the entry, never the incident (the next write of the record tries again)
        if self.on_ledger is not None:
            self.on_ledger(str(data.get("id")), entry)

    def _stored(self, incident_id: str) -> None:
        if self.on_stored is not None:
            self.on_stored(incident_id)

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
        if moved:
            self._stored(incident_id)
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
        self._ledger(data)

    def abandon(self, draft: Draft) -> None:
        """Drop a draft whose report went elsewhere: its directory, and its index row where the index takes it."""
        shutil.rmtree(draft.path, ignore_errors=True)
        try:
            with self._db() as db:
                db.execute("DELETE FROM incidents WHERE id=? AND status='capturing'", (draft.id,))
        except sqlite3.Error:
            pass  # a row left 'capturing' is never listed; adopt() or recover() settles it

    def adopt(self, src: Path, row: dict[str, Any]) -> Path:
        """Store a report assembled elsewhere (the spool): copy it in, then index it, all or nothing.
        Again after a crash cut it short: a copy already indexed (heal finishes a lost index's
        drafts) is the report stored; one that is not is replaced."""
        incident_id = row["id"]
        partial = self.dir / f".partial-{incident_id}"
        final = self.dir / incident_id
        if final.is_dir() and self._indexed(incident_id):
            return final
        try:
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)  # not indexed: a copy a crash left behind
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
        try:
            record = json.loads((final / "incident.json").read_text())
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict):
            self._ledger(record)
        self._stored(incident_id)
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
        for gone in self.dir.glob(f"{REMOVING}*"):
            shutil.rmtree(gone, ignore_errors=True)  # retention had taken it out of the index already
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

    # -- retention (retention.py decides what goes) -----------------------

    def retention_rows(self) -> dict[str, tuple[float, str, int]]:
        """Every index row, as retention weighs it: id -> (time, status, evidence pending).
        StoreError when the index cannot be read."""
        try:
            with self._db() as db:
                return {r[0]: (r[1], r[2], r[3] or 0)
                        for r in db.execute("SELECT id, time, status, pending FROM incidents")}
        except sqlite3.Error as exc:
            raise unreadable(self.index, exc) from None

    @contextmanager
    def removing(self) -> Iterator[Callable[[str], None]]:
        """A function that removes one stored incident, through one connection for them all:
        out of the index first (a listed incident always has its directory), then out of sight
        in one rename (``.removing-ID``, cleared at start if a crash cuts it short), then deleted.
        StoreWriteError when the index cannot take it."""
        db: sqlite3.Connection | None = None

        def remove(incident_id: str) -> None:
            nonlocal db
            try:
                if db is None:
                    db = sqlite3.connect(self.index, timeout=10, isolation_level=None)
                    db.execute("PRAGMA synchronous=NORMAL")
                db.execute("DELETE FROM incidents WHERE id=?", (incident_id,))
            except sqlite3.Error as exc:
                raise _write_failure(self.root, exc) from exc
            gone = self.dir / f"{REMOVING}{incident_id}"
            try:
                os.rename(self.dir / incident_id, gone)
            except FileNotFoundError:
                return
            shutil.rmtree(gone, ignore_errors=True)

        try:
            yield remove
        finally:
            if db is not None:
                db.close()

    # -- reading (the index: index.py) ----------------------------------

    def list(self, limit: int | None = None, since: float | None = None, job: str | None = None) -> list[dict[str, Any]]:
        """Incidents newest first, all of them unless limited; never one still being captured.
        StoreError when the index cannot be read."""
        return Index(self.root).page(limit, since, job).items

    def page(self, limit: int | None = None, since: float | None = None, job: str | None = None,
             before: str | None = None) -> Page:
        return Index(self.root).page(limit, since, job, before)

    def captured(self, since: float, alive: Callable[[ProcessId], bool], limit: int = ADOPT_MAX) -> dict[ProcessId, str]:
        """The processes still running (``alive``) that an incident stored since ``since`` captured,
        each with its newest incident: what a restarted daemon adopts as captured instead of
        declaring the same hang again. Reads the index, then only the incidents naming a pid that
        runs (their incident.json, written by the daemon); StoreError when the index cannot be read."""
        found: dict[ProcessId, str] = {}
        for row in self.list(limit, since):
            pids = [p for p in row.get("processes") or [] if isinstance(p, int) and os.path.exists(f"/proc/{p}")]
            if not pids:
                continue
            for key in _processes(Path(row["dir"]), pids):
                if key not in found and alive(key):
                    found[key] = str(row["id"])
        return found

    def path_of(self, incident_id: str) -> Path | None:
        """The directory of a listed incident, by id or unique prefix."""
        return Index(self.root).find(incident_id)


def _processes(incident: Path, pids: list[int]) -> list[ProcessId]:
    """Which of ``pids`` an incident captured, with their start times: from its incident.json, or, for
    one a stop interrupted (its incident.json says nothing of them), from each one's proc.json."""
    def start_times(path: Path) -> Any:
        try:
            return json.loads(path.read_bytes()[:MAX_INCIDENT_JSON])
        except (OSError, ValueError):
            return None

    data = start_times(incident / "incident.json")
    listed = data.get("processes") if isinstance(data, dict) else None
    if not isinstance(listed, list):
        listed = [start_times(incident / str(pid) / "proc.json") for pid in pids]
    found = []
    for p in listed:
        pid, start = (p.get("pid"), p.get("start_time")) if isinstance(p, dict) else (None, None)
        if isinstance(pid, int) and isinstance(start, int) and pid in pids:
            found.append(ProcessId(pid, start))
    return found
