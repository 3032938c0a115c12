"""The incident store with real files and real SQLite: atomic listing, recovery, retention."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from hangwatchd.incidents.store import Store
from hangwatchd.model import Incident


def make(store: Store, when: float, dump_bytes: int) -> str:
    draft = store.begin("heartbeat", "job", [1], now=when)
    (draft.path / "1").mkdir()
    (draft.path / "1" / "symbolized.json").write_text("{}")
    (draft.path / "1" / "coredump.nvcudmp.zst").write_bytes(b"x" * dump_bytes)
    store.commit(draft, Incident(draft.id, when, "h", "heartbeat", "d", "job"), "s")
    return draft.id


def test_a_draft_is_never_listed_until_committed(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.open()
    draft = store.begin("heartbeat", None, [1])
    assert store.list() == []
    store.commit(draft, Incident(draft.id, draft.time, "h", "heartbeat", "d", None), "s")
    assert [i["id"] for i in store.list()] == [draft.id]
    mode = sqlite3.connect(store.index).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_recovery_finishes_or_marks_incomplete(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.open()
    half = store.begin("heartbeat", None, [1])
    (half.path / "1").mkdir()
    (half.path / "1" / "proc.json").write_text("{}")
    assert store.recover() == [half.id]
    (inc,) = store.list()
    assert inc["complete"] is False and (Path(inc["dir"]) / "1" / "proc.json").exists()


def test_retention_drops_dumps_first_oldest_first_then_incidents(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.open()
    now = time.time()
    old = make(store, now - 10 * 86400, 100_000)
    mid = make(store, now - 2 * 86400, 100_000)
    new = make(store, now - 60, 100_000)
    # Dumps past 7 days go; the reports stay.
    removed = store.enforce_retention(max_bytes=10**9, dump_max_age=7 * 86400, incident_max_age=90 * 86400, now=now)
    assert removed == [str(store.dir / old / "1" / "coredump.nvcudmp.zst")]
    assert (store.dir / old / "1" / "symbolized.json").exists()
    # Over the size bound: the oldest remaining dump goes first, and the reports still stay.
    store.enforce_retention(max_bytes=store._size() - 50_000, dump_max_age=7 * 86400, incident_max_age=90 * 86400, now=now)
    assert not (store.dir / mid / "1" / "coredump.nvcudmp.zst").exists()
    assert (store.dir / new / "1" / "coredump.nvcudmp.zst").exists()
    assert {i["id"] for i in store.list()} == {old, mid, new}
    # Incidents past their age go whole, index entry too.
    store.enforce_retention(max_bytes=10**9, dump_max_age=7 * 86400, incident_max_age=5 * 86400, now=now)
    assert {i["id"] for i in store.list()} == {mid, new} and not (store.dir / old).exists()
