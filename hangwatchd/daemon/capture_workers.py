"""Hangs and exception dumps made into incidents on worker threads: handed out, collected when done.

The loop never waits for a capture. A confirmed hang (or another node's
request for this node's ranks of a job) goes to a worker that captures,
analyses and stores (``make_incident``); an exception dump goes to one that
files it (``dump_ingest``). When a worker is done the loop collects it: the
incident is counted, announced to the fleet, and its processes marked
captured (or, when no incident came of it, watched again).

Each ordinary user's captures and dumps are held to that user's budgets
(``host.user_limits.Budgets``): one capture in flight per uid (the rest wait
in a bounded queue of their own), seconds in capture per hour, dumps per
minute; so one user's flood never takes the workers another user's hang needs.
A store request pauses a process (py-spy) at most once per REQUEST_PAUSE_EVERY.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ..analyze.jsonfile import read_json_or_none
from ..capture import capture_budget
from ..capture.base import Step
from ..config import Config
from ..detect.machine import StateMachine
from ..fleet.agent import Agent
from ..incidents.spool import Spool
from ..incidents.store import Store
from ..metrics import Metrics
from ..model import Registration, State, Suspicion
from ..watch.admission import Registrations
from ..watch.watched import Watched, Watchlist
from ..workload import dump_names, exits
from . import exception_dumps
from .act import Acting
from .gpu_dump_gate import gpu_dump_veto
from .make_incident import make_incident

log = structlog.get_logger("hangwatchd.daemon")

CLOCK_SKEW = 30.0  # seconds two nodes' clocks may differ by, comparing one's request to the other's registrations
REQUEST_PAUSE_EVERY = 3600.0  # seconds: a process captured on a store request is not paused for another before this
MAX_WAITING = 16  # captures of one uid queued behind its budget; past it a hang is tried again later
WEDGED_AFTER = 30.0  # seconds past its own deadline a capture may run before the daemon calls itself unhealthy
INGESTED_MAX = 10_000  # exception-dump names remembered in memory (oldest forgotten first; the store keeps all)
CAPTURES_MAX = 64  # captures (hangs and dumps) queued or running at once; past it a hang waits for its retry


class Saturated(Exception):
    """The capture queue is full: the hang is captured at its retry (see ``StateMachine.declare``)."""


class OverBudget(Exception):
    """Its user's capture budget is spent: the hang is captured at its retry."""


@dataclass
class _Capture:
    watched: list[Watched]
    suspicion: Suspicion
    started: float
    deadline: float  # monotonic: every step of it is cut here
    future: concurrent.futures.Future[Any]  # the incident id (an exception dump's: exception_dumps.Filed), or None
    job_incident: str | None = None
    requested: str | None = None  # the action another node's capture request carried
    uid: int | None = None  # whose budget it is charged to


class CaptureWorkers:
    def __init__(self, config: Config, store: Store, spool: Spool, steps: list[tuple[Step, float]], metrics: Metrics,
                 watched: Watchlist, registrations: Registrations, fleet: Agent | None, wake: Callable[..., None]) -> None:
        self.config = config
        self.store = store
        self.spool = spool
        self.steps = steps
        self.metrics = metrics
        self.watched = watched
        self.registrations = registrations
        self.fleet = fleet
        self.wake = wake  # a worker is done: wake the loop to collect it
        self.machine: StateMachine | None = None  # set once made: it hands hangs here
        self.act: Acting | None = None  # set by the daemon: what follows a stored incident (on_hang)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="capture")
        self.captures: list[_Capture] = []
        self.dumping: set[int] = set()  # pids whose GPU dump a capture is taking: not exception dumps
        self.ingested: dict[str, None] = {}  # dump files already made into incidents, oldest first (INGESTED_MAX)
        self.flushing: concurrent.futures.Future[None] | None = None  # the spool being flushed, off the loop
        self.jobs_at = 0.0  # when the fleet's list of jobs watched here is next refreshed
        self.budgets = registrations.limits.budgets  # per-user: captures in flight, capture time, dumps, log lines
        self.waiting: dict[int, collections.deque[Callable[[], None]]] = {}  # uid -> captures held by its budget
        self.requested: dict[object, float] = {}  # process -> when a store request last had it captured

    def healthy(self, now: float) -> bool:
        """No capture is running past its own deadline (and a grace for its last step to be killed)."""
        return all(now < c.deadline + WEDGED_AFTER for c in self.captures)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Other slow work of the loop's (retention, the spool), on the same workers."""
        return self.pool.submit(self._logged, fn, *args)

    @staticmethod
    def _logged(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            log.exception("worker_failed", work=getattr(fn, "__name__", str(fn)), error=f"{type(exc).__name__}: {exc}")
            raise

    def remember_ingested(self, names: set[str] | list[str]) -> None:
        for name in names:
            self.ingested[name] = None
        while len(self.ingested) > INGESTED_MAX:
            del self.ingested[next(iter(self.ingested))]

    def shutdown(self) -> None:
        """Stop: queued captures are dropped (logged), running ones end at their deadlines, and
        every capture that finished is logged and counted like any other."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        for c in self.captures:
            if c.future.cancelled():
                log.warning("capture_cancelled", pids=[w.process.pid for w in c.watched], reason=c.suspicion.reason,
                            why="the daemon stopped before it started")
        self.captures = [c for c in self.captures if not c.future.cancelled()]
        self.collect()

    # -- hangs -------------------------------------------------------------

    def on_hung(self, group: list[Watched], suspicion: Suspicion, deadline: float, job_incident: str | None,
                requested: str | None = None) -> None:
        """A confirmed hang (the hung process and its job-mates): queue their capture, cut at
        ``deadline``, within its user's budget (a capture whose user has one in flight waits for it).
        Raises when it cannot be queued; the caller then retries later. ``requested``: the action
        another node's capture request carried."""
        if len(self.captures) >= CAPTURES_MAX:
            raise Saturated(f"{len(self.captures)} captures queued or running (CAPTURES_MAX)")
        uid = group[0].registration.uid
        outcome = self._admit(uid, lambda: self._start(group, suspicion, deadline, job_incident, requested))
        if outcome == "deferred":
            raise OverBudget(f"uid {uid}'s capture budget is spent")
        if outcome == "start":
            self._start(group, suspicion, deadline, job_incident, requested)

    def _start(self, group: list[Watched], suspicion: Suspicion, deadline: float, job_incident: str | None,
               requested: str | None) -> None:
        w = group[0]
        gone = self.registrations.departures.of_job(w.registration.job, w.registration.uid, w.registration.registered_at)  # job-mates that exited: often the cause
        if gone:
            log.info("exited_job_mates", job=w.registration.job, pids=[d.registration.process.pid for d in gone])
        declare = job_incident is None and self.fleet is not None and w.registration.job is not None
        on_hang = self.act.action(x.registration for x in group) if self.act and declare else "report"
        c = _Capture(list(group), suspicion, time.monotonic(), deadline, concurrent.futures.Future(), job_incident, requested,
                     uid=w.registration.uid)
        c.future = self.pool.submit(self._capture, c, [x.registration for x in group], w.notify_status(), gone,
                                    declare, on_hang)
        c.future.add_done_callback(self.wake)
        self.captures.append(c)
        self.dumping.update(x.process.pid for x in group)

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

    def serve_requests(self) -> None:
        """Another node declared a job hung: capture this node's ranks of it now, whatever they look like here."""
        if self.fleet is None:
            return
        now = time.monotonic()
        if now >= self.jobs_at:  # the jobs watched here, for the fleet's poller: at most once a second (O(watched))
            self.fleet.jobs = frozenset((w.registration.uid, w.registration.job) for w in self.watched.values()
                                        if w.registration.job)
            self.jobs_at = now + 1.0
        for req in self.fleet.pending():
            # A rank registered after the request belongs to a restarted job of the same name, not this hang
            # (give or take the skew between two nodes' clocks).
            now = time.monotonic()
            self.requested = {p: t for p, t in self.requested.items() if now - t < REQUEST_PAUSE_EVERY}
            # A job is (owner, name): another user's job of the same name elsewhere is not this one.
            of_job = [w for w in self.watched.values() if w.registration.job == req.job and w.role != "launcher"
                      and (req.uid is None or w.registration.uid == req.uid)
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
                continue
            for x in group:
                self.requested[x.process] = now
            log.warning("job_capture_requested", job=req.job, job_incident=req.job_incident, by=req.node,
                        pids=[w.process.pid for w in group])
            why = Suspicion("job-request", f"node {req.node} declared job {req.job} hung ({req.reason}: {req.detail})", req.time)
            assert self.machine is not None
            self.machine.declare(group, why, time.monotonic(), req.job_incident, requested=req.on_hang)

    def _capture(self, c: _Capture, targets: list[Registration], notify_status: str | None,
                 gone: list[exits.Departed], declare: bool, on_hang: str = "report") -> str | None:
        """On a worker thread: tell the fleet, capture, analyse, store, hand the incident to the fleet."""
        suspicion = c.suspicion
        job = targets[0].job
        if declare and self.fleet is not None and job is not None:
            try:  # every other node watching a rank of this job captures it too, under one job incident id
                c.job_incident = self.fleet.declare(job, suspicion.reason, suspicion.detail, on_hang, targets[0].uid)
            except Exception as exc:  # noqa: BLE001 - the fleet's trouble costs the request, never this node's capture
                log.exception("job_declare_failed", job=job, error=f"{type(exc).__name__}: {exc}")
        first = str(targets[0].process.pid)

        def gate(outdir: Path) -> str | None:  # a job-mate's GPU dump needs its own evidence
            return gpu_dump_veto(self.config.gpu_dump, outdir, suspicion.signals if outdir.name == first else (),
                                 suspicion.reason)

        budget = c.deadline - time.monotonic()
        if budget <= 0:
            raise TimeoutError(f"its deadline passed while it waited for a worker ({-budget:.1f} s ago)")
        incident_id = make_incident(self.store, self.steps, targets, suspicion, budget, self.metrics, gate,
                                    notify_status, self.spool, gone, self.config.node, c.job_incident)
        if self.fleet and incident_id and self.spool.find(incident_id) is None:
            self.fleet.stored(incident_id, self.store.dir / incident_id, next((t.job for t in targets if t.job), None),
                              c.job_incident)
        return incident_id

    def collect(self) -> None:
        """The workers that are done: count and announce their incidents, move their processes on."""
        for c in [c for c in self.captures if c.future.done()]:
            self.captures.remove(c)
            self._release(c)
            reason = c.suspicion.reason
            try:
                incident_id = c.future.result()
                if isinstance(incident_id, exception_dumps.Filed):  # an exception dump: linked to its process, or not
                    reason = reason if incident_id.linked else "unattributed-dump"
                    incident_id = incident_id.incident
            except Exception as exc:  # noqa: BLE001 - a failed capture must never stop the loop
                log.error("capture_failed", pids=[w.process.pid for w in c.watched], error=f"{type(exc).__name__}: {exc}",
                          exc_info=exc)
                self.metrics.loop_errors.labels(**self.metrics.labels(where="capture")).inc()
                incident_id = None
            else:
                if incident_id is None:
                    continue  # a refused dump: counted and logged already
                self.metrics.incidents.labels(**self.metrics.labels(reason=reason)).inc()
                self.metrics.incident_stored(incident_id, reason, c.watched[0].registration.job if c.watched else None, time.time())
                pending = self.spool.find(incident_id) is not None if incident_id else False
                log.warning("incident_pending" if pending else "incident_stored", incident=incident_id,
                            reason=reason, pids=[w.process.pid for w in c.watched],
                            seconds=round(time.monotonic() - c.started, 3))
                if pending:
                    self.metrics.incidents_pending.labels(**self.metrics.const).set(len(self.spool.pending()))
                if self.act and c.suspicion.reason != "gpu-exception":  # stored (or its report kept): now the job's policy acts
                    self.act.after_store([w.registration for w in c.watched], incident_id, c.requested)
            now = time.monotonic()
            for w in c.watched:
                self.dumping.discard(w.process.pid)
                if self.watched.get(w.process) is not w:
                    continue  # gone meanwhile (or an exception dump's stand-in)
                assert self.machine is not None
                if incident_id is None:
                    self.machine.capture_failed(w, now)
                else:
                    self.machine.stored(w, incident_id)

    # -- GPU dumps nobody asked for: exceptions ---------------------------

    def dump_appeared(self, name: str) -> None:
        if not (name.endswith(".nvcudmp") or name.endswith(dump_names.DRIVER_LOG_SUFFIX)) or name in self.ingested:
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
        future = self.pool.submit(exception_dumps.ingest_counted, self.store, self.config.dumps / name, pid, reg,
                                  self.config.driver_logs, self.metrics, self.spool,
                                  lambda uid: self.budgets.allow("log", uid, time.monotonic()))
        future.add_done_callback(self.wake)
        fake = Watched(reg, State.CAPTURED, seen_at=time.monotonic(), timeout=0) if reg else None  # a stand-in, never watched
        self.captures.append(_Capture([fake] if fake else [], Suspicion("gpu-exception", name, time.time()),
                                      time.monotonic(), time.monotonic() + capture_budget(self.config), future,
                                      uid=owner))

    # -- reports kept while the state dir was full -------------------------

    def flush_spool(self) -> None:
        """Reports kept while the state dir had no room: stored and indexed once it has, on a worker
        (it analyses and renders pages), one flush at a time."""
        if self.flushing is not None and not self.flushing.done():
            return
        self.flushing = self.submit(self._flush_spool)

    def _flush_spool(self) -> None:
        pending = self.spool.pending()
        if pending:
            for incident_id in self.spool.flush(self.store):
                log.warning("incident_stored", incident=incident_id, from_spool=True)
                if self.fleet:  # the store's copy waited for the local one
                    meta = read_json_or_none(self.store.dir / incident_id / "incident.json") or {}
                    self.fleet.stored(incident_id, self.store.dir / incident_id, meta.get("job"), meta.get("job_incident"))
        self.metrics.incidents_pending.labels(**self.metrics.const).set(len(self.spool.pending()) if pending else 0)
