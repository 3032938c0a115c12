"""The incident index, ``STATE_DIR/index.sqlite``: one summary row per incident, read.

Listing and finding are SQL over the whole index, filters and limits in the
query, newest first: nothing stored is out of reach, however many there are.
This module is what ``hangwatchd incidents`` and ``show`` load (with no logging
or metrics library): a person waits for it, so it imports little.

A fault of the index is said for what it is: a corrupt file (the daemon moves it
aside and rebuilds it from the incident directories when it starts, ``heal``),
a missing one beside stored incidents (the same), a full disk.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import sqlite3  # imported where the index is opened: `show ID` of a whole id never opens it

INDEX = "index.sqlite"
INCIDENTS = "incidents"
WHOLE_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}")  # store.new_id's: names its directory alone

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

# SQLite's primary result codes that mean the file is no (longer a) database, and those of a
# disk that is full or failing.
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26
SQLITE_IOERR, SQLITE_FULL = 10, 13
REBUILT_AT_START = ("the daemon moves it aside and rebuilds it from the incident directories when it starts: "
                    "restart it (systemctl restart hangwatchd)")


class StoreError(Exception):
    """The state dir cannot be used: the message says which and what to do."""


def corrupt(exc: sqlite3.Error) -> bool:
    """Whether SQLite says the index file is damaged (rather than the disk full, or busy)."""
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (SQLITE_CORRUPT, SQLITE_NOTADB)


def unreadable(index: Path, exc: sqlite3.Error) -> StoreError:
    """What to tell a person whose index cannot be read, by what SQLite says is wrong."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if corrupt(exc):
        return StoreError(f"the incident index {index} is corrupt ({exc}); {REBUILT_AT_START}")
    if code in (SQLITE_IOERR, SQLITE_FULL):
        return StoreError(f"cannot read the incident index {index} ({exc}); "
                          f"if the disk is full, free space there (df {index.parent})")
    return StoreError(f"cannot read the incident index {index} ({exc})")


class Page(NamedTuple):
    """Incidents newest first, and how many more match past them (older ones). A NamedTuple
    (immutable all the same), not a dataclass: importing dataclasses costs `hangwatchd
    incidents` 5 ms, a tenth of its whole run."""

    items: list[dict[str, Any]]
    more: int


@contextmanager
def reading(index: Path) -> Iterator[sqlite3.Connection]:
    """The index for reading, also where it cannot be written: by a user who may not write
    the state dir (``hangwatchd incidents`` as the owner of an incident), or on a full disk.
    Read-only, and where SQLite cannot make its shared-memory file, an immutable snapshot."""
    import sqlite3

    db: sqlite3.Connection | None = None
    if os.access(index.parent, os.W_OK):
        db = sqlite3.connect(index, timeout=10, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError:
            db.close()
            db = None
    if db is None:
        uri = index.absolute().as_uri()
        db = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=10)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.OperationalError:
            db.close()  # no -shm to share (the daemon is between writes): a snapshot
            db = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=10)
    try:
        yield db
    finally:
        db.close()


class Index:
    """Reading the index of the state dir ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.path = self.root / INDEX
        self.dir = self.root / INCIDENTS

    def page(self, limit: int | None = None, since: float | None = None, job: str | None = None,
             before: str | None = None) -> Page:
        """Incidents newest first, never one still being captured: at most ``limit`` (None: all),
        from ``since`` (a Unix time) on, of ``job``, older than incident ``before``. A user who is
        not root sees the incidents they may open (their own, see ``permissions``).
        StoreError when the index cannot be read."""
        import sqlite3

        if not self.path.exists():
            self._missing()
            return Page([], 0)
        where: list[str] = ["status != 'capturing'"]
        args: list[str | float] = []
        if since is not None:
            where.append("time >= ?")
            args.append(since)
        if job is not None:
            where.append("job = ?")
            args.append(job)
        try:
            with reading(self.path) as db:
                if before is not None:
                    row = db.execute("SELECT time FROM incidents WHERE id = ?", (before,)).fetchone()
                    if row is None:
                        raise StoreError(f"no incident '{before}' in {self.root} to list the incidents before; "
                                         "'hangwatchd incidents' lists them")
                    where.append("(time < ? OR (time = ? AND id < ?))")
                    args += [row[0], row[0], before]
                # An index no daemon of this version has opened yet has no pending column: none is pending.
                pending = "pending" if any(r[1] == "pending" for r in db.execute("PRAGMA table_info(incidents)")) else "0"
                query = (f"SELECT id, time, host, reason, job, status, processes, summary, {pending} FROM incidents "
                         f"WHERE {' AND '.join(where)} ORDER BY time DESC, id DESC")
                if os.geteuid() == 0:
                    rows = db.execute(query + (" LIMIT ?" if limit is not None else ""),
                                      (*args, limit) if limit is not None else args).fetchall()
                    more = 0
                    if limit is not None and len(rows) == limit:
                        (total,) = db.execute(f"SELECT count(*) FROM incidents WHERE {' AND '.join(where)}", args).fetchone()
                        more = total - limit
                else:  # filtered by access, which SQL cannot see: row by row, all of them counted
                    rows, more = [], 0
                    for r in db.execute(query, args):
                        if not os.access(self.dir / r[0], os.R_OK | os.X_OK):
                            continue
                        if limit is None or len(rows) < limit:
                            rows.append(r)
                        else:
                            more += 1
        except sqlite3.Error as exc:
            raise unreadable(self.path, exc) from None
        return Page([self._item(r) for r in rows], more)

    def _item(self, r: tuple[Any, ...]) -> dict[str, Any]:
        return {"id": r[0], "time": r[1], "host": r[2], "reason": r[3], "job": r[4], "complete": r[5] == "complete",
                "processes": json.loads(r[6]), "summary": r[7], "pending": r[8] or 0, "dir": str(self.dir / r[0])}

    def find(self, prefix: str) -> Path | None:
        """The directory of a stored incident, by id or unique prefix: a whole id names its
        directory (stored once its incident.json is there); a prefix is looked up in the index,
        by its own order, so any stored incident, however old. StoreError when the index cannot
        be read."""
        if not prefix or "/" in prefix or prefix.startswith(".") or "\0" in prefix:
            return None
        if WHOLE_ID.fullmatch(prefix) and (self.dir / prefix / "incident.json").is_file():
            return self._readable(self.dir / prefix)
        import sqlite3

        if not self.path.exists():
            self._missing()
            return None
        try:
            with reading(self.path) as db:
                ids = [r[0] for r in db.execute(
                    "SELECT id FROM incidents WHERE id >= ? AND id < ? AND status != 'capturing' ORDER BY id LIMIT 2",
                    (prefix, prefix + "\U0010ffff"))]
        except sqlite3.Error as exc:
            raise unreadable(self.path, exc) from None
        return self._readable(self.dir / ids[0]) if len(ids) == 1 else None

    @staticmethod
    def _readable(path: Path) -> Path | None:
        if os.geteuid() != 0 and not os.access(path, os.R_OK | os.X_OK):
            return None  # another user's: not theirs to know of
        return path

    def _missing(self) -> None:
        """No index: a fresh state dir, or one whose index was lost beside stored incidents."""
        try:
            with os.scandir(self.dir) as entries:
                stored = any(not e.name.startswith(".") for e in entries)
        except OSError:
            return
        if stored:
            raise StoreError(f"the incident index {self.path} is missing, while incidents are stored in {self.dir}; "
                             f"{REBUILT_AT_START}")
