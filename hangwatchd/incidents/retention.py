"""What is kept, and for how long: the store's incidents and dumps by size and age, and stale
driver logs; on a thread of its own, on its own schedule.

One pass is one walk of the store (``footprint.measure``: every file stat'ed once), one
read of the index, then removals, oldest first, each subtracted from the total: raw dumps
past their age, then raw dumps while over the size bound (the user whose dumps hold the most
bytes first: one user's flood never costs another's dump), then whole incidents past their
age or while over the bound. The reports outlive the dumps. A pass over 10,000 incidents
takes well under a second (bench/incidents_scale.py); the one before walked the whole
tree again for every incident it looked at.

The thread (``Retention``) runs a pass as the daemon starts, every ``retention_interval`` seconds,
and as soon as what the store stored takes it past ``max_state_bytes``: the store tells it
each incident it stored files into, and it measures that one. It never waits for captures,
and never removes what one is writing: a draft (``.partial-ID``) is no incident yet, and an
incident whose evidence is still coming (``pending`` in its index row, a ``.late-ID-*``
beside it) or whose row still says ``capturing`` is left for a later pass. It checks its
stop between removals and inside the walk: the daemon stops within a second of SIGTERM.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import structlog

from ..config import Config
from . import footprint
from .footprint import Stopped
from .store import Store, StoreError

log = structlog.get_logger("hangwatchd.retention")

DRIVER_LOG_KEEP = 3600.0  # seconds a launcher's driver-log copy outlives its process
STOP_WITHIN = 1.0  # seconds the daemon waits for a pass to notice it should stop
DUMP_NOTE = "cuda_dump-notes.txt"
OWNER_READ = 4 << 20  # bytes of incident.json read for its owner (the daemon wrote it)


@dataclass(frozen=True)
class Limits:
    max_bytes: float
    dump_max_age: float  # seconds
    incident_max_age: float  # seconds

    @classmethod
    def of(cls, cfg: Config) -> Limits:
        return cls(cfg.max_state_bytes, cfg.dump_max_age_days * 86400, cfg.incident_max_age_days * 86400)


@dataclass(frozen=True)
class Pass:
    removed: tuple[str, ...]  # paths, for the log
    total: int  # the store's bytes once done
    sizes: dict[str, int]  # each incident kept: its bytes
    stopped: bool = False  # asked to stop before it was done


def enforce(store: Store, limits: Limits, now: float | None = None, stop: threading.Event | None = None) -> Pass:
    """One pass: drop what ``limits`` no longer keep, oldest first, never what a capture writes;
    each removal logged as it is made."""
    now = time.time() if now is None else now
    try:
        held = footprint.measure(store, stop)
    except Stopped:
        return Pass((), 0, {}, stopped=True)
    rows = store.retention_rows()
    # Oldest first; only settled incidents, none a capture still adds to.
    settled = sorted((rows[i][0], i) for i in held.incidents
                     if i in rows and rows[i][1] != "capturing" and not rows[i][2] and i not in held.busy)
    sizes = {i: h.bytes for i, h in held.incidents.items()}
    total = held.total
    removed: list[str] = []

    def stopping() -> bool:
        return stop is not None and stop.is_set()

    def drop_dumps(incident_id: str) -> None:
        nonlocal total
        for path, size in held.incidents[incident_id].dumps:
            if Path(path).exists():
                freed = size - _drop_dump(Path(path))
                total -= freed
                sizes[incident_id] -= freed
                removed.append(path)
                log.info("retention_removed", path=path)

    for when, incident_id in settled:  # raw dumps past their age
        if now - when <= limits.dump_max_age or stopping():
            break
        drop_dumps(incident_id)
    # Raw dumps while over: the user whose dumps hold the most bytes gives first (their oldest
    # first), so one user's flood of dumps never costs another user's.
    queues: dict[int | None, deque[str]] = {}
    held_by: Counter[int | None] = Counter()
    for _when, incident_id in settled:
        if held.incidents[incident_id].dumps and total > limits.max_bytes:
            owner = _owner(store.dir / incident_id)
            queues.setdefault(owner, deque()).append(incident_id)
            held_by[owner] += sum(size for _, size in held.incidents[incident_id].dumps)
    while total > limits.max_bytes and queues and not stopping():
        owner = max(queues, key=lambda o: held_by[o])
        incident_id = queues[owner].popleft()
        if not queues[owner]:
            del queues[owner]
        held_by[owner] -= sum(size for _, size in held.incidents[incident_id].dumps)
        drop_dumps(incident_id)
    with store.removing() as remove:
        for when, incident_id in settled:  # whole incidents past their age, or oldest first while over
            if not (now - when > limits.incident_max_age or total > limits.max_bytes) or stopping():
                break
            remove(incident_id)
            total -= sizes.pop(incident_id)
            removed.append(str(store.dir / incident_id))
            log.info("retention_removed", path=removed[-1])
    return Pass(tuple(removed), total, sizes, stopped=stopping())


def _owner(directory: Path) -> int | None:
    """The uid of the user whose process an incident is about (its first process); None unknown."""
    try:
        with open(directory / "incident.json", "rb") as f:
            data = json.loads(f.read(OWNER_READ))
        uid = data["processes"][0]["uid"]
        return uid if isinstance(uid, int) else None
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _drop_dump(dump: Path) -> int:
    """Remove a raw dump, leaving a note where it was; the bytes the note added."""
    dump.unlink(missing_ok=True)
    note = dump.parent / DUMP_NOTE
    before = footprint.allocated(str(note))
    with open(note, "a") as f:
        f.write("the raw dump was removed by retention; symbolized.json keeps what it said\n")
    return footprint.allocated(str(note)) - before


def drop_stale_driver_logs(directory: Path, now: float | None = None) -> None:
    """A launcher's copies of its processes' driver lines (``UID/PID.log``), past DRIVER_LOG_KEEP."""
    cutoff = (time.time() if now is None else now) - DRIVER_LOG_KEEP
    for stale in directory.glob("*/*.log"):
        try:
            if stale.lstat().st_mtime < cutoff:
                stale.unlink()
        except OSError:
            pass


class Retention:
    """Retention's thread: a pass at start, every ``retention_interval``, and when the store goes past its bound."""

    def __init__(self, cfg: Config) -> None:
        self.store = Store(cfg.state_dir)  # the daemon's Store tells this one what it stored: see stored()
        self.limits = Limits.of(cfg)
        self.driver_logs = cfg.driver_logs
        self.every = cfg.retention_interval
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._grown: set[str] = set()  # incidents stored into since the thread last looked
        self._sizes: dict[str, int] = {}  # each incident's bytes at the last pass
        self._total = 0  # the store's bytes: the last pass's, plus what grew since
        self._thread: threading.Thread | None = None
        self.last: Pass | None = None  # the last pass that ran to its end

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="retention", daemon=True)
        self._thread.start()

    def stored(self, incident_id: str) -> None:
        """The store stored files into ``incident_id`` (on whatever thread stored them)."""
        with self._lock:
            self._grown.add(incident_id)
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread, a pass under way included: it notices within STOP_WITHIN."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(STOP_WITHIN * 2)
            if self._thread.is_alive():
                log.warning("retention_still_running", why="a removal took longer than it should; the daemon exits without it")

    def _run(self) -> None:
        due = time.monotonic()  # the first pass, at start
        while not self._stop.is_set():
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() >= due or self._over():
                    self._pass()
                    due = time.monotonic() + self.every
            except Stopped:
                return
            except Exception as exc:
                log.exception("retention_failed", error=f"{type(exc).__name__}: {exc}")
                due = time.monotonic() + self.every

    def _over(self) -> bool:
        """Whether the incidents stored since the last pass take the store past its bound
        (each measured alone, not the whole store)."""
        with self._lock:
            grown, self._grown = self._grown, set()
        for incident_id in grown:
            size = footprint.tree(str(self.store.dir / incident_id), self._stop).bytes
            self._total += size - self._sizes.get(incident_id, 0)
            self._sizes[incident_id] = size
        return self._total > self.limits.max_bytes

    def _pass(self) -> None:
        started = time.monotonic()
        with self._lock:
            self._grown.clear()  # the pass measures them all
        try:
            done = enforce(self.store, self.limits, stop=self._stop)
        except (OSError, StoreError) as exc:  # a full or broken index: the next pass tries again
            log.error("retention_failed", error=str(exc))
            return
        if done.stopped:
            log.info("retention_stopped", removed=len(done.removed), why="the daemon is stopping")
            return
        self._sizes, self._total = done.sizes, done.total
        self.last = done
        log.info("retention_checked", store_bytes=done.total, max_state_bytes=self.limits.max_bytes,
                 incidents=len(done.sizes), removed=len(done.removed), seconds=round(time.monotonic() - started, 3))
        drop_stale_driver_logs(self.driver_logs)
