"""Hangs and exception dumps made into incidents on worker threads: handed out, and back as values.

The loop never waits for a capture. A confirmed hang (or another node's
request for this node's ranks of a job) goes to a worker that captures,
analyses and stores (``make_incident``); an exception dump goes to one that
files it (``dump_ingest``). Each worker ends by posting one ``CaptureDone``
to the loop's queue, from a ``finally``: the incident, or the error that
stopped it. The loop hands it to ``finished``, which counts and announces the
incident and says, for each process, what became of it; the state machine
moves them on (captured, or HUNG with a retry due). Workers get
registrations, never a ``Watched``.

Each ordinary user's captures and dumps are held to that user's budgets
(``host.user_limits.Budgets``): one capture in flight per uid (the rest wait
in a bounded queue of their own), seconds in capture per hour, dumps per
minute; so one user's flood never takes the workers another user's hang needs.
A store request pauses a process (py-spy) at most once per REQUEST_PAUSE_EVERY.
"""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import itertools
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ..analyze.jsonfile import read_json_or_none
from ..analyze.slow import SLOW_FILE
from ..capture import capture_budget, slow_steps
from ..capture.base import Step
from ..config import Config
from ..detect.machine import Declare
from ..detect.pace_machine import DeclareSlow
from ..fleet.agent import Agent, CaptureRequest
from ..host.deadline import Deadline
from ..host.dump_fifos import ExceptionBegun, ExceptionDrained, ExceptionFifos
from ..incidents.spool import Spool
from ..incidents.store import Store
from ..metrics import Metrics
from ..model import ProcessId, Registration, State, Suspicion, in_job, pace_to_dict
from ..watch.admission import Registrations
from ..watch.watched import Watched, Watchlist, notify_status
from ..workload import dump_names, exits
from . import exception_capture, exception_dumps
from .act import Acting
from .gpu_dump_gate import gpu_dump_veto
from .make_incident import Making, make_incident
from .work_pool import WorkPool

log = structlog.get_logger("hangwatchd.daemon")

CLOCK_SKEW = 30.0  # seconds two nodes' clocks may differ by, comparing one's request to the other's registrations
REQUEST_PAUSE_EVERY = 3600.0  # seconds: a process captured on a store request is not paused for another before this
MAX_WAITING = 16  # captures of one uid queued behind its budget; past it a hang is tried again later
WEDGED_AFTER = 30.0  # seconds past its own deadline a capture may run before the daemon calls itself unhealthy
INGESTED_MAX = 10_000  # exception-dump names remembered in memory (oldest forgotten first; the store keeps all)
CAPTURES_MAX = 64  # captures (hangs and dumps) queued or running at once; past it a hang waits for its retry
WORKERS = 4  # threads that capture, analyse and store; none of them waits out a window or the slow evidence


@dataclass(frozen=True)
class CaptureDone:
    """A capture's (or an exception dump's) worker is done: its incident, or why there is none."""

    capture: int
    incident: str | None = None  # None: no incident came of it (``error`` says why; none for a dump refused and counted)
    linked: bool = True  # an exception dump: whether it was linked to the process its name gives
    error: str | None = None


@dataclass(frozen=True)
class CaptureLooked:
    """A capture's stacks are in and its worker given back while a window passes (``progress``'s):
    the loop has it finished at ``ready_at`` (monotonic)."""

    capture: int
    ready_at: float


@dataclass(frozen=True)
class ChoreDone:
    """Other slow work of the loop's on the same workers (the spool, retention): done, or its error."""

    name: str
    error: str | None = None


@dataclass
class _Capture:
    watched: list[Watched]  # the processes whose fate waits on it (none for an exception dump)
    registrations: list[Registration]
    suspicion: Suspicion
    started: float
    deadline: Deadline  # every step of it is cut here
    id: int = 0
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    job_incident: str | None = None
    requested: str | None = None  # the action another node's capture request carried
    uid: int | None = None  # whose budget it is charged to
    pace: tuple[int, str] | None = None  # a slow job's capture: its (uid, job); nobody's fate waits on it
    begun: ExceptionBegun | None = None  # an exception caught alive: what its FIFO gave first
    looked: exception_capture.ExceptionLooked | None = None  # its stacks taken, its draft


class CaptureWorkers:
    def __init__(self, config: Config, store: Store, spool: Spool, steps: list[tuple[Step, float]], metrics: Metrics,
                 watched: Watchlist, registrations: Registrations, fleet: Agent | None, post: Callable[[object], None],
                 act: Acting | None = None, fifos: ExceptionFifos | None = None) -> None:
        self.config = config
        self.store = store
        self.spool = spool
        self.steps = steps
        self.slow_steps = slow_steps(config)  # a slow job's capture: stacks and NVML only
        self.metrics = metrics
        self.watched = watched
        self.registrations = registrations
        self.fleet = fleet
        self.post = post  # the loop's queue: each worker's CaptureDone or ChoreDone
        self.act = act  # what follows a stored incident (on_hang)
        self.fifos = fifos  # the exception FIFOs, where the daemon keeps them
        self.exceptions: dict[ProcessId, int] = {}  # process -> the capture of the exception caught in it
        self.pool = WorkPool(WORKERS, "capture")
        self.due: list[tuple[float, int]] = []  # (when, capture): captures waiting out a window (a heap, the loop's)
        self._lock = threading.Lock()  # the workers' side: captures parked, and those whose slow evidence is coming
        self._parked: dict[int, Making] = {}  # capture -> its incident, looked at, to finish once its window passed
        self._late: set[Making] = set()  # stored, their slow evidence still coming (on threads of their own)
        self._stopping = False
        self.captures: dict[int, _Capture] = {}
        self._ids = itertools.count(1)
        self.dumping: set[int] = set()  # pids whose GPU dump a capture is taking: not exception dumps
        self.ingested: dict[str, None] = {}  # dump files already made into incidents, oldest first (INGESTED_MAX)
        self.flushing = False  # the spool is being flushed, off the loop
        self.jobs_at = 0.0  # when the fleet's list of jobs watched here is next refreshed
        self.budgets = registrations.limits.budgets  # per-user: captures in flight, capture time, dumps, log lines
        self.waiting: dict[int, collections.deque[Callable[[], None]]] = {}  # uid -> captures held by its budget
        self.requested: dict[object, float] = {}  # process -> when a store request last had it captured

    def healthy(self, now: float) -> bool:
        """No capture is running past its own deadline (and a grace for its last step to be killed)."""
        return all(now < c.deadline.at + WEDGED_AFTER for c in self.captures.values())

    def submit(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """Other slow work of the loop's (retention, the spool), on the same workers; a ``ChoreDone`` follows."""
        self.pool.submit(self._chore, name, fn, *args)

    def _chore(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        error: str | None = "stopped before it finished"
        try:
            fn(*args)
            error = None
        except Exception as exc:  # the loop hears of it as this chore's error
            log.exception("worker_failed", work=name, error=f"{type(exc).__name__}: {exc}")
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.post(ChoreDone(name, error))

    def chore_done(self, done: ChoreDone) -> None:
        """On the loop: a chore is over (its error logged where it happened, counted here)."""
        if done.name == "spool":
            self.flushing = False
        if done.error is not None:
            self.metrics.loop_errors.labels(**self.metrics.labels(where=done.name)).inc()

    def remember_ingested(self, names: set[str] | list[str]) -> None:
        for name in names:
            self.ingested[name] = None
        while len(self.ingested) > INGESTED_MAX:
            del self.ingested[next(iter(self.ingested))]

    def shutdown(self) -> None:
        """Stop: queued captures are dropped (logged), running ones end at their deadlines; one waiting
        out a window is finished now (the window as it was), and slow evidence coming is waited for (cut
        at its capture's deadline). Each that ran has posted its CaptureDone: the loop hands those to
        ``finished`` like any other."""
        with self._lock:
            self._stopping = True
            parked, self._parked = self._parked, {}
        for capture, making in parked.items():
            self.pool.submit(self._finish, capture, making, first=True)
        self.pool.shutdown(wait=True, cancel_new=True)
        with self._lock:
            coming = list(self._late)
        for making in coming:
            making.wait_late()
        for c in list(self.captures.values()):
            if c.future.cancelled():
                log.warning("capture_cancelled", pids=[r.process.pid for r in c.registrations], reason=c.suspicion.reason,
                            why="the daemon stopped before it started")
                del self.captures[c.id]

    # -- hangs -------------------------------------------------------------

    def start(self, d: Declare) -> str | None:
        """A confirmed hang (the hung process and its job-mates): queue their capture, cut at
        ``d.deadline``, within its user's budget (a capture whose user has one in flight waits for
        it). None when queued; else why not (the state machine then has it tried again later)."""
        if len(self.captures) >= CAPTURES_MAX:
            return f"{len(self.captures)} captures queued or running (CAPTURES_MAX)"
        group = list(d.group)
        uid = group[0].registration.uid
        outcome = self._admit(uid, lambda: self._start(group, d))
        if outcome == "deferred":
            return f"uid {uid}'s capture budget is spent"
        if outcome == "start":
            self._start(group, d)
        return None

    def _start(self, group: list[Watched], d: Declare) -> None:
        w = group[0]
        regs = [x.registration for x in group]
        gone = self.registrations.departures.of_job(w.registration)  # job-mates that exited: often the cause
        if gone:
            log.info("exited_job_mates", job=w.registration.job, pids=[g.registration.process.pid for g in gone])
        declare = d.job_incident is None and self.fleet is not None and w.registration.job is not None
        on_hang = self.act.action(regs) if self.act and declare else "report"
        c = _Capture(group, regs, d.suspicion, time.monotonic(), d.deadline, next(self._ids), job_incident=d.job_incident,
                     requested=d.requested, uid=w.registration.uid)
        c.future = self.pool.submit(self._capture, c.id, regs, d.suspicion, d.deadline, c.job_incident,
                                    notify_status(w.registration), gone, declare, on_hang)
        self.captures[c.id] = c
        self.dumping.update(x.process.pid for x in group)

    # -- slow jobs --------------------------------------------------------------

    def start_slow(self, d: DeclareSlow) -> str | None:
        """A slow episode to file here: capture its ranks (stacks and NVML only: never a GPU dump, never
        an abort, no request to the other nodes) with the job's records beside them, within its user's
        budget. None when queued; else why not (an episode is filed once: it is not tried again)."""
        if len(self.captures) >= CAPTURES_MAX:
            return f"{len(self.captures)} captures queued or running (CAPTURES_MAX)"
        uid = d.key[0]
        outcome = self._admit(uid, lambda: self._start_slow(d))
        if outcome == "deferred":
            return f"uid {uid}'s capture budget is spent"
        if outcome == "start":
            self._start_slow(d)
        return None

    def _start_slow(self, d: DeclareSlow) -> None:
        regs = [w.registration for w in d.group]
        c = _Capture([], regs, d.suspicion, time.monotonic(), Deadline.after(self.config.capture_timeout), next(self._ids),
                     uid=d.key[0], pace=d.key)
        beside = {SLOW_FILE: json.dumps({"node": self.config.node, "records": [pace_to_dict(r) for r in d.records]},
                                        indent=1).encode()}
        c.future = self.pool.submit(self._capture_slow, c.id, regs, d.suspicion, c.deadline, beside)
        self.captures[c.id] = c

    def _capture_slow(self, capture: int, targets: list[Registration], suspicion: Suspicion, deadline: Deadline,
                      beside: dict[str, bytes]) -> None:
        done = CaptureDone(capture, error="the worker stopped before it finished")
        try:
            incident = make_incident(self.store, self.slow_steps, targets, suspicion, deadline, self.metrics, None,
                                     None, self.spool, (), self.config.node, None, beside)
            done = CaptureDone(capture, incident)
        except Exception as exc:  # the loop hears of it as this capture's error
            done = CaptureDone(capture, error=f"{type(exc).__name__}: {exc}")
            log.error("capture_failed", pids=[t.process.pid for t in targets], error=done.error, exc_info=exc)
        finally:
            self.post(done)

    def pace_of(self, done: CaptureDone) -> tuple[int, str] | None:
        """The job whose slow episode a finished capture filed (None: not a slow job's)."""
        c = self.captures.get(done.capture)
        return c.pace if c is not None else None

    def _admit(self, uid: int | None, later: Callable[[], None]) -> str:
        """"start" when ``uid``'s budget lets this capture start now; "queued" when its slot is taken
        (``later`` runs when one frees); "deferred" past its capture time or its queue."""
        now = time.monotonic()
        why = self.budgets.start_capture(uid, now)
        if why is None:
            if self.budgets.allow("incident", uid, now):
                return "start"
            self.budgets.end_capture(uid, 0.0, now)  # the slot back: this one is not taken
            why = (f"uid {uid} had its {self.budgets.per_minute['incident']:g} incidents this minute "
                   "(incidents_per_uid_per_minute)")
        assert uid is not None
        queue = self.waiting.setdefault(uid, collections.deque())
        if self.budgets.in_flight(uid) > 0 and len(queue) < MAX_WAITING:
            queue.append(later)
            outcome = "queued"
        else:
            outcome = "deferred"
        self.metrics.registration_errors.labels(**self.metrics.labels(reason="capture_budget")).inc()
        if self.budgets.allow("log", uid, now):
            log.warning("capture_over_budget", uid=uid, outcome=outcome, error=why)
        return outcome

    def _release(self, c: _Capture) -> None:
        """A capture is done: its user's slot back, its time charged, the user's next waiting one started."""
        now = time.monotonic()
        self.budgets.end_capture(c.uid, now - c.started, now)
        if not c.uid:
            return
        queue = self.waiting.get(c.uid)
        if queue:
            queue.popleft()()
        if not queue:
            self.waiting.pop(c.uid, None)

    def tell_fleet(self, now: float) -> None:
        """The jobs watched here, for the fleet's poller: at most once a second (O(watched))."""
        if self.fleet is not None and now >= self.jobs_at:
            self.fleet.jobs = frozenset((w.registration.uid, w.registration.job) for w in self.watched.values()
                                        if w.registration.job)
            self.jobs_at = now + 1.0

    def requested_group(self, req: CaptureRequest, now: float) -> list[Watched]:
        """Another node declared a job hung: this node's ranks of it to capture now, whatever they look
        like here (none when they are in hand already, or were paused for a request lately)."""
        assert self.fleet is not None
        # A rank registered after the request belongs to a restarted job of the same name, not this hang
        # (give or take the skew between two nodes' clocks).
        self.requested = {p: t for p, t in self.requested.items() if now - t < REQUEST_PAUSE_EVERY}
        # A job is (owner, name): another user's job of the same name elsewhere is not this one.
        of_job = [w for w in self.watched.values() if in_job(w.registration, req.job, req.uid, w.role)
                  and w.registration.registered_at <= req.time + CLOCK_SKEW]
        # Paused for a request once per REQUEST_PAUSE_EVERY; one hung or captured here is in hand already.
        group = [w for w in of_job if w.state in (State.STARTING, State.HEALTHY, State.SUSPECT)
                 and w.process not in self.requested]
        if of_job and not group:
            log.warning("job_capture_request_ignored", job=req.job, job_incident=req.job_incident, by=req.node,
                        why=f"its processes here were captured on a store request less than "
                            f"{REQUEST_PAUSE_EVERY:g} s ago; they are not paused again for one"
                        if any(w.process in self.requested for w in of_job)
                        else "its processes here are hung, or captured for a hang of their own, already")
        if not group or not self.fleet.accept(req):
            return []
        for x in group:
            self.requested[x.process] = now
        log.warning("job_capture_requested", job=req.job, job_incident=req.job_incident, by=req.node,
                    pids=[w.process.pid for w in group])
        return group

    def _capture(self, capture: int, targets: list[Registration], suspicion: Suspicion, deadline: Deadline,
                 job_incident: str | None, notify: str | None, gone: list[exits.Departed], declare: bool,
                 on_hang: str) -> None:
        """On a worker thread: tell the fleet, then the capture's first turn (``Making.look``: facts,
        stacks, each window's first look). Where a window is still open, the worker is given back and
        a ``CaptureLooked`` asks the loop to have it finished once the window has passed (``resume``);
        else it is finished here. Whatever happens, one CaptureDone follows on the loop's queue."""
        try:
            making = self._look(targets, suspicion, deadline, job_incident, notify, gone, declare, on_hang)
            ready_at = making.look()
            with self._lock:
                park = ready_at > time.monotonic() and not self._stopping
                if park:
                    self._parked[capture] = making
        except Exception as exc:  # noqa: BLE001 - the loop hears of it as this capture's error (logged there)
            self._failed(capture, targets, exc)
            return
        except BaseException:
            self.post(CaptureDone(capture, error="the worker stopped before it finished"))
            raise
        if park:
            self.post(CaptureLooked(capture, ready_at))
        else:
            self._finish(capture, making)

    def _look(self, targets: list[Registration], suspicion: Suspicion, deadline: Deadline, job_incident: str | None,
              notify: str | None, gone: list[exits.Departed], declare: bool, on_hang: str) -> Making:
        job = targets[0].job
        if declare and self.fleet is not None and job is not None:
            try:  # every other node watching a rank of this job captures it too, under one job incident id
                job_incident = self.fleet.declare(job, suspicion.reason, suspicion.detail, on_hang, targets[0].uid)
            except Exception as exc:  # the fleet's trouble costs the request, never this node's capture
                log.exception("job_declare_failed", job=job, error=f"{type(exc).__name__}: {exc}")
        first = str(targets[0].process.pid)

        def gate(outdir: Path) -> str | None:  # a job-mate's GPU dump needs its own evidence
            return gpu_dump_veto(self.config.gpu_dump, outdir, suspicion.signals if outdir.name == first else (),
                                 suspicion.reason)

        if deadline.passed():
            raise TimeoutError(f"its deadline passed while it waited for a worker ({time.monotonic() - deadline.at:.1f} s ago)")
        return Making(self.store, self.steps, targets, suspicion, deadline, self.metrics, gate, notify, self.spool, gone,
                      self.config.node, job_incident, runtime_dir=Path(self.config.runtime_dir))

    def looked(self, looked: CaptureLooked) -> None:
        """On the loop: a capture waits out a window; it is finished once that has passed (``resume``)."""
        heapq.heappush(self.due, (looked.ready_at, looked.capture))

    def next_due(self) -> float:
        """When the next capture waiting out a window is to be finished (monotonic; inf: none)."""
        return self.due[0][0] if self.due else float("inf")

    def resume(self, now: float) -> None:
        """On the loop: each capture whose window has passed goes back to a worker, before any new one."""
        while self.due and self.due[0][0] <= now:
            _, capture = heapq.heappop(self.due)
            self.pool.submit(self._resume, capture, first=True)

    def _resume(self, capture: int) -> None:
        with self._lock:
            making = self._parked.pop(capture, None)
        if making is not None:  # else the daemon's stop finished it already
            self._finish(capture, making)

    def _finish(self, capture: int, making: Making) -> None:
        """On a worker: the capture's last turn, the incident stored. Its CaptureDone follows once the
        slow evidence is in, from the thread that takes it: no worker waits for it."""
        try:
            incident_id = making.finish()
        except Exception as exc:  # noqa: BLE001 - the loop hears of it as this capture's error (logged there)
            self._failed(capture, making.targets, exc)
            return
        except BaseException:
            self.post(CaptureDone(capture, error="the worker stopped before it finished"))
            raise
        with self._lock:
            self._late.add(making)
        making.then(lambda: self._handed(capture, making, incident_id))

    def _handed(self, capture: int, making: Making, incident_id: str) -> None:
        """The capture is over, its slow evidence in: the incident handed to the fleet; one CaptureDone."""
        done = CaptureDone(capture, error="the worker stopped before it finished")
        try:
            if self.fleet and self.spool.find(incident_id) is None:
                self.fleet.stored(incident_id, self.store.dir / incident_id,
                                  next((t.job for t in making.targets if t.job), None), making.job_incident)
            done = CaptureDone(capture, incident_id)
        except Exception as exc:  # the loop hears of it as this capture's error
            done = CaptureDone(capture, error=f"{type(exc).__name__}: {exc}")
            log.error("capture_failed", pids=making.pids, error=done.error, exc_info=exc)
        finally:
            with self._lock:
                self._late.discard(making)
            self.post(done)

    def _failed(self, capture: int, targets: list[Registration], exc: Exception) -> None:
        done = CaptureDone(capture, error=f"{type(exc).__name__}: {exc}")
        log.error("capture_failed", pids=[t.process.pid for t in targets], error=done.error, exc_info=exc)
        self.post(done)

    def finished(self, done: CaptureDone) -> list[tuple[Watched, str | None]]:
        """On the loop: a worker is done. Its incident counted and announced, the job's policy applied;
        returns each process whose fate waited on it, with its incident (None: none came of it)."""
        c = self.captures.pop(done.capture, None)
        if c is None:
            return []
        self._release(c)
        if c.begun is not None and self.exceptions.get(c.begun.registration.process) == c.id:
            del self.exceptions[c.begun.registration.process]
        reason = c.suspicion.reason
        pids = [r.process.pid for r in c.registrations]
        for pid in pids:
            self.dumping.discard(pid)
        incident_id = done.incident
        if done.error is not None:
            if c.suspicion.reason == "gpu-exception":
                log.error("capture_failed", pids=pids, error=done.error)  # a dump's worker logs nothing itself
            self.metrics.loop_errors.labels(**self.metrics.labels(where="capture")).inc()
        elif incident_id is not None:
            reason = reason if done.linked else "unattributed-dump"
            self.metrics.incidents.labels(**self.metrics.labels(reason=reason)).inc()
            self.metrics.incident_stored(incident_id, reason, c.registrations[0].job if c.registrations else None, time.time())
            pending = self.spool.find(incident_id) is not None
            log.warning("incident_pending" if pending else "incident_stored", incident=incident_id,
                        reason=reason, pids=pids, seconds=round(time.monotonic() - c.started, 3))
            if pending:
                self.metrics.incidents_pending.labels(**self.metrics.const).set(len(self.spool.pending()))
            if self.act and c.suspicion.reason != "gpu-exception" and c.pace is None:  # stored: now the job's policy acts (a slow job: never)
                self.act.after_store(c.registrations, incident_id, c.requested)
        else:
            return []  # a refused dump: counted and logged already
        return [(w, incident_id) for w in c.watched]

    # -- GPU dumps nobody asked for: exceptions ---------------------------

    def dump_appeared(self, name: str) -> None:
        if not exception_dumps.is_dump_name(name) or name in self.ingested:
            return
        pid = dump_names.pid_of(name)
        if pid is not None and pid in self.dumping:
            return  # a capture asked for this one and takes it itself
        try:
            st = os.lstat(self.config.dumps / name)  # a dir entry: whose budget it spends
        except OSError:
            return  # gone already
        owner: int | None = st.st_uid
        now = time.monotonic()
        if not stat.S_ISREG(st.st_mode):  # refused here, at no cost to a worker or the user's dump budget
            reason = "dump_symlink" if stat.S_ISLNK(st.st_mode) else "dump_not_regular"
            self.remember_ingested([name])
            self.metrics.registration_errors.labels(**self.metrics.labels(reason=reason)).inc()
            if self.budgets.allow("log", owner, now):
                log.warning("dump_refused", file=name, reason=reason, uid=owner, error=f"{name}: not a regular file")
            return
        if not self.budgets.allow("dump", owner, now):
            # Not remembered as ingested: a rescan (start, overflow) takes it once the user is under budget.
            self.metrics.registration_errors.labels(**self.metrics.labels(reason="dump_budget")).inc()
            if self.budgets.allow("log", owner, now):
                log.warning("dump_refused", file=name, reason="dump_budget", uid=owner,
                            error=f"uid {owner} is past dumps_per_uid_per_minute = "
                                  f"{self.budgets.per_minute['dump']:g}; left in the dump dir")
            return
        self.remember_ingested([name])
        self._ingest(name, pid, owner)

    def _ingest(self, name: str, pid: int | None, owner: int | None) -> None:
        outcome = self._admit(owner, lambda: self._ingest(name, pid, owner))
        if outcome == "deferred":
            self.ingested.pop(name, None)  # left in the dump dir for a later scan
        if outcome != "start":
            return
        reg = self.registrations.registration_of(pid)  # here on the loop, which owns the watchlist; the worker gets the answer
        if reg is not None and reg.uid != owner:
            reg = None  # a file naming another user's process is not that process's: never its pid in our lines
        c = _Capture([], [reg] if reg else [], Suspicion("gpu-exception", name, time.time()), time.monotonic(),
                     Deadline.after(capture_budget(self.config)), next(self._ids), uid=owner)
        c.future = self.pool.submit(self._file_dump, c.id, name, pid, reg)
        self.captures[c.id] = c

    def _file_dump(self, capture: int, name: str, pid: int | None, reg: Registration | None) -> None:
        """On a worker: an exception dump filed (or refused), then, whatever happened, one CaptureDone."""
        done = CaptureDone(capture, error="the worker stopped before it finished")
        try:
            filed = exception_dumps.ingest_counted(self.store, self.config.dumps / name, pid, reg, self.config.driver_logs,
                                                   self.metrics, self.spool,
                                                   lambda uid: self.budgets.allow("log", uid, time.monotonic()))
            done = CaptureDone(capture, filed.incident if filed else None, filed.linked if filed else True)
        except Exception as exc:  # noqa: BLE001 - the loop hears of it as this dump's error
            done = CaptureDone(capture, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.post(done)

    # -- GPU exceptions caught alive, through the daemon's FIFOs --------------

    def start_exception(self, begun: ExceptionBegun, group: list[Watched]) -> str | None:
        """The driver began an exception's dump in a process's FIFO (on the loop): its capture started,
        or queued behind the user's capture in flight (the driver waits meanwhile; the deadline starts
        when the capture does). Past the user's budget, or with too many captures, the FIFO is let go
        (the driver's write fails, as with no daemon) and the reason returned; None when started or queued."""
        assert self.fifos is not None
        reg = begun.registration
        uid, now = reg.uid, time.monotonic()
        why = None
        if reg.process in self.exceptions:
            why = "an exception of this process is being captured already"
        elif len(self.captures) >= CAPTURES_MAX:
            why = f"{len(self.captures)} captures queued or running (CAPTURES_MAX)"
        elif not self.budgets.allow("dump", uid, now):
            why = f"uid {uid} is past dumps_per_uid_per_minute = {self.budgets.per_minute['dump']:g}"
        outcome = "refused" if why else self._admit(uid, lambda: self._start_exception(begun, group))
        if outcome == "deferred":
            why = f"uid {uid}'s capture budget is spent"
        if why:
            self.fifos.drain(reg.process, None, 0.0, f"not captured: {why}")
            self.metrics.registration_errors.labels(**self.metrics.labels(reason="dump_budget")).inc()
            if self.budgets.allow("log", uid, now):
                log.warning("exception_refused", pid=reg.process.pid, uid=uid, error=why)
            return why
        if outcome == "start":
            self._start_exception(begun, group)
        else:
            self.exceptions[reg.process] = 0  # queued: no second one meanwhile
        return None

    def _start_exception(self, begun: ExceptionBegun, group: list[Watched]) -> None:
        reg = begun.registration
        deadline = Deadline.after(self.config.capture_timeout + self.config.gpu_dump_timeout)
        why = Suspicion("gpu-exception", f"the driver began writing a GPU exception's dump into {begun.fifo}", begun.since)
        c = _Capture(group, [reg], why, time.monotonic(), deadline, next(self._ids), uid=reg.uid, begun=begun)
        self.captures[c.id] = c
        self.exceptions[reg.process] = c.id
        log.warning("exception_begun", pid=reg.process.pid, job=reg.job, fifo=begun.fifo, coredump=begun.coredump)
        c.future = self.pool.submit(self._exception_look, c.id, begun, deadline)

    def _exception_look(self, capture: int, begun: ExceptionBegun, deadline: Deadline) -> None:
        """On a worker: the stacks, then one ExceptionLooked on the loop's queue, whatever happened."""
        looked = exception_capture.ExceptionLooked(capture, None, None, "the worker stopped before it finished")
        try:
            looked = exception_capture.look(capture, begun, list(self.steps), deadline, self.store, self.spool,
                                            self.metrics)
        except Exception as exc:  # the loop hears of it as this capture's error
            looked = exception_capture.ExceptionLooked(capture, None, None, f"{type(exc).__name__}: {exc}")
            log.error("capture_failed", pids=[begun.registration.process.pid], error=looked.error, exc_info=exc)
        finally:
            self.post(looked)

    def exception_looked(self, looked: exception_capture.ExceptionLooked) -> CaptureDone | None:
        """On the loop: the stacks are in; the dump is asked of the FIFO's thread. A CaptureDone to
        hand on where the capture ends here (its stacks could not be taken)."""
        c = self.captures.get(looked.capture)
        if c is None or c.begun is None:
            return None
        assert self.fifos is not None
        c.looked = looked
        exception_capture.drain_into(self.fifos, c.begun, looked, c.deadline)
        if looked.error or looked.draft is None:
            return CaptureDone(c.id, error=looked.error or "no draft")
        return None

    def exception_drained(self, drained: ExceptionDrained) -> None:
        """On the loop: the dump is read (or as much as came): filed by a worker."""
        cid = self.exceptions.get(drained.registration.process)
        c = self.captures.get(cid) if cid else None
        if c is None or c.begun is None or c.looked is None or c.looked.draft is None or c.looked.captured is None:
            if drained.path:  # its capture ended without it (an error said so): the bytes go
                Path(drained.path).unlink(missing_ok=True)
            return
        looked, begun = c.looked, c.begun
        c.future = self.pool.submit(self._exception_file, c.id, begun, drained, looked, c.deadline, first=True)

    def _exception_file(self, capture: int, begun: ExceptionBegun, drained: ExceptionDrained,
                        looked: exception_capture.ExceptionLooked, deadline: Deadline) -> None:
        done = CaptureDone(capture, error="the worker stopped before it finished")
        assert looked.draft is not None and looked.captured is not None
        try:
            done = CaptureDone(capture, exception_capture.file(begun, drained, looked.draft, looked.captured, deadline,
                                                               self.store, self.spool, self.config.driver_logs,
                                                               self.metrics, self.config.node))
        except Exception as exc:  # the loop hears of it as this capture's error
            done = CaptureDone(capture, error=f"{type(exc).__name__}: {exc}")
            log.error("capture_failed", pids=[begun.registration.process.pid], error=done.error, exc_info=exc)
        finally:
            self.post(done)

    # -- reports kept while the state dir was full -------------------------

    def flush_spool(self) -> None:
        """Reports kept while the state dir had no room: stored and indexed once it has, on a worker
        (it analyses and renders pages), one flush at a time."""
        if not self.flushing:
            self.flushing = True
            self.submit("spool", self._flush_spool)

    def _flush_spool(self) -> None:
        pending = self.spool.pending()
        if pending:
            for incident_id in self.spool.flush(self.store):
                log.warning("incident_stored", incident=incident_id, from_spool=True)
                if self.fleet:  # the store's copy waited for the local one
                    meta = read_json_or_none(self.store.dir / incident_id / "incident.json") or {}
                    self.fleet.stored(incident_id, self.store.dir / incident_id, meta.get("job"), meta.get("job_incident"))
        self.metrics.incidents_pending.labels(**self.metrics.const).set(len(self.spool.pending()) if pending else 0)
