"""Retention with real files and real SQLite: oldest first while over the bound, linear, never
what a capture is writing, on its own thread (triggered by what the store stores), stoppable.
How fast a pass is over 10,000 incidents is bench/incidents_scale.py's to say."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from hangwatchd.config import Config
from hangwatchd.incidents import footprint
from hangwatchd.incidents.retention import Limits, Retention, drop_stale_driver_logs, enforce
from hangwatchd.incidents.store import Store
from hangwatchd.model import Incident, PendingEvidence, ProcessCapture, ProcessId, Registration
from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

from .many import fill

DAY = 86400
KEEP_ALL = Limits(10**15, 7 * DAY, 90 * DAY)


def make(store: Store, when: float, dump_bytes: int, pending: bool = False, stacks_bytes: int = 0, uid: int | None = None) -> str:
    """A real incident through the store's own begin and commit: a raw dump of ``dump_bytes`` (if
    any), its evidence still coming if ``pending``, stacks of ``stacks_bytes``; about a process of
    user ``uid`` where given."""
    draft = store.begin("heartbeat", "job", [1], now=when)
    (draft.path / "1").mkdir()
    (draft.path / "1" / "symbolized.json").write_text("{}")
    (draft.path / "1" / "pyspy.json").write_bytes(os.urandom(stacks_bytes))
    if dump_bytes:
        (draft.path / "1" / "coredump.nvcudmp.zst").write_bytes(os.urandom(dump_bytes))
    coming = (PendingEvidence(1, "cuda_dump", time.time() + 60),) if pending else ()
    processes = (ProcessCapture(Registration(ProcessId(1, 1), uid=uid), ()),) if uid is not None else ()
    store.commit(draft, Incident(draft.id, when, "h", "heartbeat", "d", "job", processes=processes, pending=coming), "s")
    return draft.id


def listed(store: Store) -> list[str]:
    return [i["id"] for i in store.list()]


def test_dumps_go_first_oldest_first_then_incidents(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.open()
    now = time.time()
    old = make(store, now - 10 * DAY, 100_000)
    mid = make(store, now - 2 * DAY, 100_000)
    new = make(store, now - 60, 100_000)
    # Dumps past 7 days go; the reports stay, with a note where the dump was.
    done = enforce(store, KEEP_ALL, now=now)
    assert done.removed == (str(store.dir / old / "1" / "coredump.nvcudmp.zst"),)
    assert (store.dir / old / "1" / "symbolized.json").exists() and (store.dir / old / "1" / "cuda_dump-notes.txt").exists()
    # Over the size bound: the oldest remaining dump goes first, and the reports still stay.
    bound = footprint.measure(store).total - 50_000
    done = enforce(store, Limits(bound, 7 * DAY, 90 * DAY), now=now)
    assert done.total <= bound and done.total == footprint.measure(store).total
    assert not (store.dir / mid / "1" / "coredump.nvcudmp.zst").exists()
    assert (store.dir / new / "1" / "coredump.nvcudmp.zst").exists()
    assert set(listed(store)) == {old, mid, new}
    # Incidents past their age go whole, index entry too.
    enforce(store, Limits(10**15, 7 * DAY, 5 * DAY), now=now)
    assert set(listed(store)) == {mid, new} and not (store.dir / old).exists()


def test_over_the_bound_the_user_whose_dumps_hold_most_gives_first(tmp_path: Path) -> None:
    """Root's dump is the oldest; user 1000 then stores three dumps twice its size: over the
    bound, user 1000's dumps go (oldest first) until it is under, and root's stays."""
    store = Store(tmp_path)
    store.open()
    now = time.time()
    root = make(store, now - 5 * 3600, 60_000, uid=0)
    flood = [make(store, now - (4 - n) * 3600, 120_000, uid=1000) for n in range(3)]
    held = footprint.measure(store)
    bound = held.total - 200_000
    done = enforce(store, Limits(bound, 7 * DAY, 90 * DAY), now=now)
    assert [Path(p).parent.parent.name for p in done.removed] == flood[:2]
    assert (store.dir / root / "1" / "coredump.nvcudmp.zst").exists()
    assert done.total <= bound and set(listed(store)) == {root, *flood}


def test_over_the_bound_the_oldest_go_until_under_it_and_no_further(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.open()
    now = time.time()
    ids = [make(store, now - (10 - n) * 3600, 50_000) for n in range(10)]  # oldest first
    held = footprint.measure(store)
    (_path, dump), = held.incidents[ids[0]].dumps
    bound = held.total - 2.5 * dump
    done = enforce(store, Limits(bound, 7 * DAY, 90 * DAY), now=now)
    # Dumps are the bulk of each: the oldest dumps go, as few as bring it under; every report stays.
    gone = [Path(p).parent.parent.name for p in done.removed]
    assert 3 <= len(gone) <= 4 and gone == ids[: len(gone)]
    assert done.total <= bound and done.total == footprint.measure(store).total
    assert listed(store) == ids[::-1]


def test_without_dumps_the_oldest_incidents_go_whole_exactly_as_many_as_needed(tmp_path: Path) -> None:
    ids = fill(tmp_path, 10, file_bytes=20_000)  # oldest first, no raw dumps
    store = Store(tmp_path)
    held = footprint.measure(store)
    bound = held.total - sum(held.incidents[i].bytes for i in ids[:7]) + 1
    done = enforce(store, Limits(bound, 7 * DAY, 90 * DAY))
    assert listed(store) == ids[7:][::-1] and done.total <= bound
    assert [Path(p).name for p in done.removed] == ids[:7] and not any((store.dir / i).exists() for i in ids[:7])
    assert not [p for p in store.dir.iterdir() if p.name.startswith(".removing-")]


def test_never_a_draft_nor_an_incident_still_receiving_evidence(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.open()
    now = time.time()
    settled = [make(store, now - (9 - n) * 3600, 100_000) for n in range(3)]
    pending = make(store, now - 10 * 3600, 100_000, pending=True)  # the oldest, its GPU dump still coming
    late_one = make(store, now - 11 * 3600, 100_000)  # older still, a late step writing beside it
    late = store.late_dir(late_one, 1, "cuda_dump")
    (late / "coredump.nvcudmp.zst").write_bytes(os.urandom(200_000))
    draft = store.begin("heartbeat", "job", [7])  # a capture in flight
    (draft.path / "7").mkdir()
    (draft.path / "7" / "pyspy.json").write_bytes(os.urandom(300_000))

    done = enforce(store, Limits(1, 7 * DAY, 90 * DAY), now=now)  # over the bound whatever is removed

    assert not any((store.dir / i).exists() for i in settled) and set(listed(store)) == {pending, late_one}
    assert (store.dir / pending / "1" / "coredump.nvcudmp.zst").exists()
    assert (store.dir / late_one / "1" / "coredump.nvcudmp.zst").exists() and (late / "coredump.nvcudmp.zst").exists()
    assert (draft.path / "7" / "pyspy.json").stat().st_size == 300_000
    assert done.total > 600_000  # what it kept is counted: the draft and the late file are the store's bytes
    # The capture goes on as if nothing happened.
    store.commit(draft, Incident(draft.id, now, "h", "heartbeat", "d", "job"), "s")
    assert listed(store)[0] == draft.id


def test_a_pass_asked_to_stop_removes_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.open()
    ids = [make(store, time.time() - n, 10_000) for n in range(5)]
    asked = threading.Event()
    asked.set()
    done = enforce(store, Limits(1, 7 * DAY, 90 * DAY), stop=asked)
    assert done.stopped and done.removed == () and set(listed(store)) == set(ids)


def test_the_store_going_past_its_bound_starts_a_pass_without_waiting_for_the_schedule(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ids = fill(state, 20, file_bytes=50_000)
    bound = footprint.measure(Store(state)).total + 30_000
    retention = Retention(Config(state_dir=str(state), runtime_dir=str(tmp_path / "run"), max_state_bytes=bound,
                                 retention_interval=3600.0))
    store = Store(state, on_stored=retention.stored)
    retention.start()
    try:
        first = wait_for(lambda: retention.last, 30, "the pass at start")
        assert first.removed == ()  # under the bound: nothing to do
        made = make(store, time.time(), 0, stacks_bytes=100_000)  # past the bound, an hour before the next pass
        wait_for(lambda: not (store.dir / ids[0]).exists(), 30, "the oldest incident removed")
        assert made in listed(store) and ids[0] not in listed(store)
    finally:
        retention.stop()
    assert not [t for t in threading.enumerate() if t.name == "retention"]


# -- in the daemon -----------------------------------------------------------------------------

def test_retention_runs_while_a_capture_is_in_flight_and_leaves_its_draft(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "py-spy").write_text("#!/bin/sh\nexec sleep 3600\n")  # a py-spy that hangs: the capture stays in flight
    (fake / "py-spy").chmod(0o755)
    config = {"pyspy_timeout": 25.0, "pyspy_native": False, "retention_interval": 1.0, "incident_max_age_days": "1h"}
    d = ScratchDaemon(tmp_path / "d", env={"PATH": f"{fake}:{os.environ['PATH']}"}, config=config)
    work = d.run(workload_argv(beats=5, interval=0.02), "--heartbeat-timeout", "1")
    try:
        (draft,) = wait_for(lambda: list((d.state_dir / "incidents").glob(".partial-*/*/proc.json")), 20, "a capture under way")
        old = fill(d.state_dir, 5, newest=time.time() - 2 * 3600)  # stored meanwhile, past incident_max_age_days
        wait_for(lambda: not any((d.state_dir / "incidents" / i).exists() for i in old), 15,
                 "the old incidents removed while the capture runs")
        assert draft.exists() and d.store().list() == []  # the capture's draft untouched, still in flight
        (inc,) = wait_for(d.settled, 40, "the capture's incident stored")
        assert (Path(inc["dir"]) / draft.parent.name / "proc.json").exists()
        assert any(e.get("event") == "retention_removed" for e in d.logs())
    finally:
        stop(work)
        d.stop()


def test_a_daemon_on_10000_incidents_stops_on_sigterm_during_a_retention_pass(tmp_path: Path) -> None:
    base = tmp_path / "d"
    fill(base / "state", 10_000, file_bytes=0)
    d = ScratchDaemon(base, config={"max_state_bytes": 4096})  # over its bound: the pass at start removes them all
    d.event("retention_removed", 60)  # a long pass under way
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    d.stop()
    events = [e.get("event") for e in d.logs()]
    assert "retention_stopped" in events and "daemon_stopping" in events
    # Nothing listed lacks its directory, and what the stop cut short is cleared at the next start.
    with ScratchDaemon(base, config={"max_state_bytes": "1GiB"}) as again:
        left = again.store().list()
        assert 0 < len(left) < 10_000 and all(Path(i["dir"]).is_dir() for i in left)
        assert not list((again.state_dir / "incidents").glob(".removing-*"))


def test_a_driver_log_is_dropped_an_hour_after_it_was_last_written_in_whichever_users_directory(tmp_path: Path) -> None:
    logs = tmp_path / "driver-logs"
    for uid, pid, age in ((0, 11, 3700), (0, 12, 60), (1000, 13, 4000), (1000, 14, 0)):
        (logs / str(uid)).mkdir(parents=True, exist_ok=True)
        f = logs / str(uid) / f"{pid}.log"
        f.write_text("coredump: Starting GPU coredump generation\n")
        os.utime(f, (time.time() - age, time.time() - age))
    drop_stale_driver_logs(logs)
    assert sorted(f"{f.parent.name}/{f.name}" for f in logs.glob("*/*.log")) == ["0/12.log", "1000/14.log"]
