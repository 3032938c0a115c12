"""A corrupt or lost index never stops the watching: the daemon moves a corrupt one aside (kept),
rebuilds the index from the incident directories at start, says so, counts it, and goes on
watching. Real daemons, real SQLite files, damaged for real."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.incidents import heal
from hangwatchd.incidents.store import Store
from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

from ..conftest import hangwatchd
from .many import fill


def listed(d: ScratchDaemon) -> list[dict[str, Any]]:
    res = hangwatchd("incidents", "--json", "--limit", "0", "--state-dir", str(d.state_dir),
                     "--runtime-dir", str(d.runtime_dir))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def not_a_database(index: Path) -> None:
    index.write_bytes(b"this is no database, it is a napkin" * 200)


def torn_pages(index: Path) -> None:
    """The header says SQLite, the pages past the first are garbage: quick_check finds it."""
    data = bytearray(index.read_bytes())
    page = int.from_bytes(data[16:18], "big") or 65536
    assert len(data) > 3 * page
    data[page:] = os.urandom(len(data) - page)
    index.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [not_a_database, torn_pages])
def test_a_corrupt_index_is_set_aside_rebuilt_and_the_daemon_watches(tmp_path: Path, damage: Callable[[Path], None]) -> None:
    base = tmp_path / "d"
    ids = fill(base / "state", 300, jobs=("train", "eval"), file_bytes=0)
    Store(base / "state").open()  # as a daemon leaves it: checkpointed, no -wal
    damage(base / "state" / "index.sqlite")
    kept = (base / "state" / "index.sqlite").read_bytes()
    with ScratchDaemon(base) as d:  # up, not exit 2
        items = listed(d)
        assert [i["id"] for i in items] == ids[::-1]
        assert items[0]["job"] == "eval" and items[0]["summary"].startswith("pid 4242: blocked in hang_here")
        (aside,) = d.state_dir.glob("index.sqlite.corrupt-*")
        assert aside.read_bytes() == kept
        logged = {e["event"]: e for e in d.logs() if e.get("event", "").startswith("index_")}
        assert logged["index_corrupt"]["kept"] == str(aside)
        assert logged["index_rebuilt"]["reason"] == "corrupt" and logged["index_rebuilt"]["indexed"] == 300
        assert d.metric("hangwatchd_index_rebuilds_total", reason="corrupt") == 1.0
        assert d.metric("hangwatchd_index_rebuilds_total", reason="missing") == 0.0
        # It watches: a hang becomes an incident, listed with the others.
        work = d.run(workload_argv(beats=5, interval=0.02), "--heartbeat-timeout", "1", stdout=subprocess.PIPE)
        try:
            (new,) = wait_for(lambda: [i for i in d.settled() if i["id"] not in ids], 30, "the hang stored")
            assert new["reason"] == "heartbeat" and len(listed(d)) == 301
        finally:
            stop(work)
    # Rebuilt once: the next start finds nothing to do.
    with ScratchDaemon(base) as d:
        assert len(listed(d)) == 301 and len(list(d.state_dir.glob("index.sqlite.corrupt-*"))) == 1
        assert [e.get("event") for e in d.logs()].count("index_rebuilt") == 1  # both daemons' lines, in one log
        assert d.metric("hangwatchd_index_rebuilds_total", reason="corrupt") == 0.0


def test_a_lost_index_is_rebuilt_at_start_and_counted_as_missing(tmp_path: Path) -> None:
    base = tmp_path / "d"
    ids = fill(base / "state", 40, file_bytes=0)
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (base / "state" / name).unlink(missing_ok=True)
    with ScratchDaemon(base) as d:
        assert [i["id"] for i in listed(d)] == ids[::-1]
        assert d.metric("hangwatchd_index_rebuilds_total", reason="missing") == 1.0
        shown = hangwatchd("show", ids[0], "--state-dir", str(d.state_dir))
        assert shown.returncode == 0 and f"Incident {ids[0]}" in shown.stdout


def test_the_index_is_made_to_match_the_directories(tmp_path: Path) -> None:
    """Each start: a directory the index lacks is indexed from its incident.json, a row whose
    directory is gone is dropped, a draft whose row was lost with the index is kept."""
    ids = fill(tmp_path, 5, jobs=("a", "b"), file_bytes=0)
    store = Store(tmp_path)
    db = sqlite3.connect(store.index, isolation_level=None)
    db.execute("DELETE FROM incidents WHERE id = ?", (ids[1],))  # its row lost
    db.close()
    (store.dir / ids[3] / "incident.json").unlink()
    os.rename(store.dir / ids[3], tmp_path / "elsewhere")  # its directory gone
    draft = store.dir / ".partial-20261129T192301Z-abcdef"  # a draft whose row went with an old index
    (draft / "77").mkdir(parents=True)
    (draft / "77" / "proc.json").write_text("{}")
    healed = heal.reconcile(store)
    assert (healed.indexed, healed.dropped) == (2, 1)
    by_id = {i["id"]: i for i in store.list()}
    assert set(by_id) == {ids[0], ids[1], ids[2], ids[4], "20261129T192301Z-abcdef"}
    assert by_id[ids[1]]["job"] == "b" and by_id[ids[1]]["complete"] and by_id[ids[1]]["processes"] == [4242]
    assert by_id[ids[1]]["summary"] == "pid 4242: blocked in hang_here (no beat for 120 s)"
    recovered = by_id["20261129T192301Z-abcdef"]
    assert not recovered["complete"] and recovered["summary"] == "interrupted by a daemon restart"
    assert (store.dir / "20261129T192301Z-abcdef" / "77" / "proc.json").exists()
    assert heal.reconcile(store) == heal.Healed(None, None, 0, 0)


def test_a_report_the_spool_was_storing_when_the_daemon_died_is_stored_once(tmp_path: Path) -> None:
    """The crash between adopt's copy and its index row left a draft with the report: heal makes it
    an incident at the next start, and the spool's flush then finds it stored instead of failing."""
    import shutil

    from hangwatchd.incidents.spool import Spool

    store = Store(tmp_path / "state")
    store.open()
    spool = Spool(tmp_path / "run" / "spool")
    draft = spool.begin("heartbeat", "train", [9])
    (draft.path / "9").mkdir()
    (draft.path / "9" / "pyspy.json").write_text("{}")
    kept = spool.keep(draft, {"id": draft.id, "time": draft.time, "reason": "heartbeat", "job": "train",
                              "complete": True, "processes": [{"pid": 9}]}, "blocked (no beat)")
    assert kept is not None
    shutil.copytree(kept, store.dir / f".partial-{draft.id}")  # where adopt had got to
    assert heal.reconcile(store).indexed == 1
    assert spool.flush(store) == [draft.id] and spool.pending() == []
    (inc,) = store.list()
    assert inc["id"] == draft.id and (Path(inc["dir"]) / "9" / "pyspy.json").exists()


def test_capture_by_hand_on_a_corrupt_index_names_it_in_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    fill(state, 2, file_bytes=0)
    not_a_database(state / "index.sqlite")
    victim = subprocess.Popen(["sleep", "60"])
    try:
        res = hangwatchd("capture", str(victim.pid), "--state-dir", str(state), "--runtime-dir", str(tmp_path / "run"))
    finally:
        stop(victim)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert f"the incident index {state / 'index.sqlite'} is corrupt" in line and "restart" in line
