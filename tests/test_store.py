"""The incident store with real files and real SQLite: atomic listing, recovery (retention: tests/incidents/)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from hangwatchd.incidents.store import Store
from hangwatchd.model import Incident


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
