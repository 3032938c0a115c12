"""The daemon: one event loop that hands the work of each stage to its room.

The loop sleeps in ``select`` until something happens: a registration file
appears (inotify), a watched process exits (its pidfd), a capture or a stack
sample finishes (a wake-up pipe), a signal arrives, or the earliest timer is
due (a process's heartbeat deadline, the rescan, systemd's watchdog). It never
blocks on what it watches: reads of /proc and of beat segments do not block,
and captures and samples run on worker threads with their own deadlines.

Who does what: ``registrations`` admits and forgets processes, ``detect``
judges them (``machine``, with stack samples from ``sampler``),
``make_incident`` captures, analyses and stores a hang, ``dump_ingest`` files
exception dumps, ``retention`` keeps the store to its limits and
``status_file`` says what is watched. The loop owns the ``Watchlist`` and
calls them in turn.
"""

from __future__ import annotations

import concurrent.futures
import os
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from inotify_simple import INotify
from inotify_simple import flags as inflags

from . import __version__, dump_ingest, dumpscan, exits, gpudump, registry, retention
from .capture import make_steps
from .config import Config
from .cudacore import sandbox
from .detect import HeartbeatDetector
from .detect.gate import gpu_dump_veto
from .detect.machine import ERROR_BACKOFF, StateMachine
from .detect.sampler import Sampler
from .detect.stack import BLOCKING, IDLE
from .fleet.agent import Agent
from .instance_lock import AlreadyRunning, InstanceLock
from .jsonfile import read_json_or_none
from .loop_guard import Guard
from .make_incident import make_incident, pages
from .metrics import Metrics, create, serve
from .model import State, Suspicion
from .notify import notify, watchdog_interval
from .registrations import Registrations
from .status_file import STATUS_EVERY, StatusFile
from .spool import SPOOL_DIR, Spool
from .store import Store, StoreWriteError
from .user_limits import UserLimits
from .watched import Watched, Watchlist

log = structlog.get_logger("hangwatchd.daemon")

CLOCK_SKEW = 30.0  # seconds two nodes' clocks may differ by, comparing one's request to the other's registrations
SPOOL_RETRY_EVERY = 5.0  # how soon a report kept in the spool is tried again once the state dir has room


class SetupError(Exception):
    """The daemon cannot start here: one line saying what and where."""


@dataclass
class _Capture:
    watched: list[Watched]
    suspicion: Suspicion
    started: float
    future: concurrent.futures.Future[str | None]
    job_incident: str | None = None


@dataclass
class Daemon:
    config: Config
    metrics: Metrics = field(default=None)  # type: ignore[assignment]  # made with the node's name below

    def __post_init__(self) -> None:
        cfg = self.config
        self.metrics = self.metrics or create(node=cfg.node)
        self.store = Store(cfg.state_dir, pages=pages)
        self.fleet = Agent(cfg.store, cfg.node, Path(cfg.state_dir), cfg.store_poll_interval, cfg.job_incident_window,
                           cfg.store_spool_max, self._wake, self._count_sends) if cfg.store else None
        self.status = StatusFile(Path(cfg.runtime_dir))
        self.watched = Watchlist(self.metrics, on_change=self._write_status)
        self.limits = UserLimits(cfg.max_registrations_per_uid, cfg.pyspy_samples_per_uid)
        self.selector = selectors.DefaultSelector()
        self.guard = Guard(self.metrics)
        self.registrations = Registrations(cfg, self.watched, self.metrics, self.limits,
                                           attach=lambda fd, p: self.selector.register(fd, selectors.EVENT_READ, p),
                                           detach=self.selector.unregister, first_look=self._first_look, guard=self.guard)
        detector = HeartbeatDetector(cfg.startup_grace, cfg.learn_timeouts, cfg.learned_timeout_factor,
                                     cfg.learned_timeout_min, cfg.learned_timeout_max, int(cfg.learn_min_beats))
        self.machine = StateMachine(cfg, detector, self.watched, self.metrics,
                                    tuple(BLOCKING) + tuple(cfg.stack_blocking_patterns), cfg.stack_idle_pattern or IDLE,
                                    on_hung=self._on_hung, on_tampered=self.registrations.tampered)
        self.sampler = Sampler(cfg.pyspy_timeout, cfg.pyspy_samples_per_uid, self.limits, self._wake)
        self.steps = make_steps(cfg)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="capture")
        self.captures: list[_Capture] = []
        self.dumping: set[int] = set()  # pids whose GPU dump a capture is taking: not exception dumps
        self.ingested: set[str] = set()  # dump files already made into incidents
        self.spool = Spool(Path(cfg.runtime_dir) / SPOOL_DIR)
        self.lock = InstanceLock(Path(cfg.runtime_dir))
        self.rescan_due = False  # the inotify queue overflowed: events were lost
        self.next_dump_scan = float("inf")  # a scan found dumps still being written: look again then
        self.stopping = False
        self.metrics_address = ""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    # -- start and stop --------------------------------------------------

    def prepare(self) -> None:
        """Everything that can fail on bad setup, before READY=1."""
        try:
            self._prepare()
        except AlreadyRunning as exc:
            raise SetupError(str(exc)) from None
        except OSError as exc:
            where = exc.filename or self.config.runtime_dir
            if exc.errno == 98:
                raise SetupError(f"metrics address {self.config.metrics_address} is in use; "
                                 "pass --metrics-address HOST:PORT") from None
            raise SetupError(f"{where}: {exc.strerror}; pass --state-dir/--runtime-dir/--dump-dir "
                             "that this user can create and write") from None

    def _prepare(self) -> None:
        cfg = self.config
        Path(cfg.runtime_dir).mkdir(parents=True, exist_ok=True)
        self.lock.acquire()  # first: a second daemon must not touch the first one's store or files
        full = self.store.open()
        if full:
            log.error("store_write_failed", error=full)
        sandbox.configure(sandbox.Limits(cfg.symbolize_cpu_seconds, int(cfg.symbolize_memory_mb), cfg.symbolize_timeout))
        sandbox.start()  # warm before the first dump arrives
        try:
            for incident_id in self.store.recover():
                log.warning("incident_recovered", incident=incident_id)
        except StoreWriteError as exc:
            log.error("recover_deferred", error=str(exc))
        self.ingested |= self.store.ingested()
        self.spool.clear_partials()
        if self.fleet:
            self.fleet.start()
        registry.prepare_dirs(Path(cfg.runtime_dir))
        cfg.dumps.mkdir(parents=True, exist_ok=True)
        if os.stat(cfg.dumps).st_uid == os.geteuid():
            os.chmod(cfg.dumps, 0o1777)  # workloads of any user write their CUDA dumps here
        cfg.driver_logs.mkdir(exist_ok=True)
        if os.stat(cfg.driver_logs).st_uid == os.geteuid():
            os.chmod(cfg.driver_logs, 0o1777)
        self.inotify = INotify()
        self.reg_wd = self.inotify.add_watch(cfg.registrations, inflags.CLOSE_WRITE | inflags.MOVED_TO | inflags.CREATE
                                             | inflags.DELETE | inflags.MOVED_FROM)
        self.dump_wd = self.inotify.add_watch(cfg.dumps, inflags.CLOSE_WRITE | inflags.MOVED_TO)
        self.selector.register(self.inotify.fileno(), selectors.EVENT_READ, "inotify")
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        if cfg.metrics_address:
            self.metrics_address = serve(self.metrics.registry, cfg.metrics_address)
        self.metrics.info.info({"version": __version__})
        self.status.write_daemon(cfg.state_dir, cfg.dumps, self.metrics_address)

    def stop(self, *_: object) -> None:
        self.stopping = True
        self._wake()

    def _wake(self, *_: object) -> None:
        """Wake the loop from another thread or a signal handler (a full pipe is awake enough)."""
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass

    def run(self) -> int:
        self.prepare()
        # SIGHUP stops cleanly like SIGTERM (README: Signals): a config reload would have to
        # re-judge every watched process under new timeouts; a restart does that plainly.
        old = {s: signal.signal(s, self.stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            self._flush_spool()
            self.rescan()
            self._scan_dumps()
            notify("READY=1")
            self.status.say(f"watching {len(self.watched)} processes")
            log.info("daemon_ready", state_dir=self.config.state_dir, runtime_dir=self.config.runtime_dir,
                     metrics=self.metrics_address, pid=os.getpid())
            self.loop()
        finally:
            notify("STOPPING=1")
            log.info("daemon_stopping", captures_in_flight=len(self.captures))
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.sampler.shutdown()
            if self.fleet:
                self.fleet.stop()
            for s, h in old.items():
                signal.signal(s, h)
            self.status.remove()
            self.lock.release()
        return 0

    # -- the loop --------------------------------------------------------

    def loop(self) -> None:
        now = time.monotonic()
        next_rescan = now + self.config.rescan_interval
        ping_every = watchdog_interval()
        next_ping = now
        next_status = now
        next_retention = now
        next_spool = now + SPOOL_RETRY_EVERY
        guard = self.guard
        while not self.stopping:
            now = time.monotonic()
            timers = [next_rescan, next_status, next_retention, next_spool, self.next_dump_scan]
            timers += [min(w.next_check, w.next_sample) for w in self.watched.values()]
            if ping_every:
                timers.append(next_ping)
            timeout = max(0.0, min(timers) - now)
            events = self.selector.select(timeout)
            started = time.monotonic()
            for key, _mask in events:
                if key.data == "inotify":
                    guard("inotify", self._on_inotify)
                elif key.data == "wake":
                    self._drain_wake()
                elif isinstance(key.data, registry.ProcessId):
                    guard("exit", self.registrations.exited, key.data)
            now = time.monotonic()
            self._collect_captures()
            self._serve_requests()
            for w, sample, native in self.sampler.ready(self.watched):
                self.machine.judge_stack(w, sample, native, now)
            for w in list(self.watched.values()):
                if w.process not in self.watched:
                    continue  # forgotten while handling an earlier one
                if w.next_check <= now and not guard("observe", self.machine.observe, w, now, pid=w.process.pid):
                    w.next_check = now + ERROR_BACKOFF
                if w.process not in self.watched:
                    continue  # dropped for a tampered file
                if w.next_sample <= now and not w.sampling and not guard("sample", self.sampler.sample, w, now, pid=w.process.pid):
                    w.next_sample = now + ERROR_BACKOFF
            if now >= self.next_dump_scan:
                self.next_dump_scan = float("inf")
                guard("scan_dumps", self._scan_dumps)
            if now >= next_rescan or self.rescan_due:
                if self.rescan_due:
                    guard("scan_dumps", self._scan_dumps)
                self.rescan_due = False
                guard("rescan", self.rescan)
                next_rescan = now + self.config.rescan_interval
            if now >= next_spool:
                guard("spool", self._flush_spool)
                next_spool = now + SPOOL_RETRY_EVERY
            if now >= next_status:
                guard("status", self._write_status)
                next_status = now + STATUS_EVERY
            if now >= next_retention and not self.captures:
                self.pool.submit(retention.enforce, self.store, self.config)
                next_retention = now + retention.RETENTION_EVERY
            if ping_every and now >= next_ping:
                if self._healthy(now):
                    notify("WATCHDOG=1")
                next_ping = now + ping_every
            self.metrics.loop_duration.labels(**self.metrics.const).observe(time.monotonic() - started)

    def _healthy(self, now: float) -> bool:
        """The loop runs (we are in it) and no capture worker is wedged past all its deadlines."""
        limit = 2 * self.config.capture_timeout + 30
        return all(now - c.started < limit for c in self.captures)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def rescan(self) -> None:
        self.registrations.rescan()

    def _on_inotify(self) -> None:
        for event in self.inotify.read(timeout=0):
            if event.mask & inflags.Q_OVERFLOW:
                # Events were dropped: registrations and dumps may have come and gone unseen.
                log.warning("inotify_overflow", action="rescanning registrations and dumps")
                self.rescan_due = True
                continue
            name = event.name
            if not name or name.startswith("."):
                continue
            if event.wd == self.dump_wd:
                self.guard("inotify_event", self._dump_appeared, name)
            else:
                self.guard("inotify_event", self.registrations.changed, name, event.mask)

    def _first_look(self, w: Watched, now: float) -> None:
        self.machine.observe(w, now)

    def _write_status(self) -> None:
        self.status.write(self.watched.values())

    # -- capture (on worker threads) -------------------------------------

    def _on_hung(self, group: list[Watched], suspicion: Suspicion) -> None:
        """A confirmed hang here (the hung process and its job-mates): capture them."""
        job = group[0].registration.job
        # Every other node watching a rank of this job captures it too, under one job incident id.
        job_incident = self.fleet.declare(job, suspicion.reason, suspicion.detail) if self.fleet and job else None
        self._start_capture(group, suspicion, job_incident)

    def _start_capture(self, group: list[Watched], suspicion: Suspicion, job_incident: str | None) -> None:
        """Capture the group on a worker, into one incident."""
        w = group[0]
        self.machine.captured(group)
        self.dumping.update(x.process.pid for x in group)
        gone = self.registrations.departures.of_job(w.registration.job, w.registration.registered_at)  # job-mates that exited: often the cause
        if gone:
            log.info("exited_job_mates", job=w.registration.job, pids=[d.registration.process.pid for d in gone])
        future = self.pool.submit(self._capture, group, suspicion, gone, job_incident)
        future.add_done_callback(self._wake)
        self.captures.append(_Capture(group, suspicion, time.monotonic(), future, job_incident))

    def _count_sends(self, outcome: str, spooled: int) -> None:  # on the uploader's thread
        self.metrics.store_sends.labels(**self.metrics.labels(outcome=outcome)).inc()
        self.metrics.store_spooled.labels(**self.metrics.const).set(spooled)

    def _serve_requests(self) -> None:
        """Another node declared a job hung: capture this node's ranks of it now, whatever they look like here."""
        if self.fleet is None:
            return
        self.fleet.jobs = frozenset(w.registration.job for w in self.watched.values() if w.registration.job)
        for req in self.fleet.pending():
            # A rank registered after the request belongs to a restarted job of the same name, not this hang
            # (give or take the skew between two nodes' clocks).
            group = [w for w in self.watched.values() if w.registration.job == req.job and w.role != "launcher"
                     and w.state in (State.STARTING, State.HEALTHY, State.SUSPECT)
                     and w.registration.registered_at <= req.time + CLOCK_SKEW]
            if not group or not self.fleet.accept(req):
                continue
            log.warning("job_capture_requested", job=req.job, job_incident=req.job_incident, by=req.node,
                        pids=[w.process.pid for w in group])
            for x in group:
                x.suspicion = None
                self.watched.set_state(x, State.HUNG)
            why = Suspicion("job-request", f"node {req.node} declared job {req.job} hung ({req.reason}: {req.detail})", req.time)
            self._start_capture(group, why, req.job_incident)

    def _capture(self, group: list[Watched], suspicion: Suspicion, gone: list[exits.Departed],
                 job_incident: str | None = None) -> str | None:
        first = str(group[0].process.pid)

        def gate(outdir: Path) -> str | None:  # a job-mate's GPU dump needs its own evidence
            return gpu_dump_veto(self.config.gpu_dump, outdir, suspicion.signals if outdir.name == first else ())

        return make_incident(self.store, self.steps, [w.registration for w in group], suspicion,
                             self.config.capture_timeout, self.metrics, gate, group[0].notify_status(), self.spool, gone,
                             self.config.node, job_incident)

    def _collect_captures(self) -> None:
        for c in [c for c in self.captures if c.future.done()]:
            self.captures.remove(c)
            try:
                incident_id = c.future.result()
            except Exception as exc:  # noqa: BLE001 - a failed capture must never stop the loop
                log.exception("capture_failed", pids=[w.process.pid for w in c.watched], error=f"{type(exc).__name__}: {exc}")
                self.metrics.loop_errors.labels(**self.metrics.labels(where="capture")).inc()
                incident_id = None
            else:
                if incident_id is None:
                    continue  # a refused dump: counted and logged already
                self.metrics.incidents.labels(**self.metrics.labels(reason=c.suspicion.reason)).inc()
                self.metrics.incident_stored(incident_id, c.suspicion.reason, c.watched[0].registration.job if c.watched else None, time.time())
                pending = self.spool.find(incident_id) is not None if incident_id else False
                log.warning("incident_pending" if pending else "incident_stored", incident=incident_id,
                            reason=c.suspicion.reason, pids=[w.process.pid for w in c.watched],
                            seconds=round(time.monotonic() - c.started, 3))
                if pending:
                    self.metrics.incidents_pending.labels(**self.metrics.const).set(len(self.spool.pending()))
                elif self.fleet and incident_id:
                    job = next((w.registration.job for w in c.watched if w.registration.job), None)
                    self.fleet.stored(incident_id, self.store.dir / incident_id, job, c.job_incident)
            for w in c.watched:
                self.dumping.discard(w.process.pid)
                w.incident = incident_id
                if w.process not in self.watched or w.state is not State.HUNG:
                    continue
                if incident_id is None:
                    self.machine.capture_failed(w, time.monotonic())
                else:
                    self.watched.set_state(w, State.CAPTURED)

    # -- GPU dumps nobody asked for: exceptions ---------------------------

    def _dump_appeared(self, name: str) -> None:
        if not (name.endswith(".nvcudmp") or name.endswith(gpudump.DRIVER_LOG_SUFFIX)) or name in self.ingested:
            return
        pid = gpudump.pid_of(name)
        if pid is not None and pid in self.dumping:
            return  # a capture asked for this one and takes it itself
        self.ingested.add(name)
        reg = self.registrations.registration_of(pid)  # here on the loop, which owns the watchlist; the worker gets the answer
        future = self.pool.submit(dump_ingest.ingest_counted, self.store, self.config.dumps / name, pid, reg,
                                  self.config.driver_logs, self.metrics, self.spool)
        future.add_done_callback(self._wake)
        fake = Watched(reg, State.CAPTURED, seen_at=time.monotonic(), timeout=0) if reg else None
        self.captures.append(_Capture([fake] if fake else [], Suspicion("gpu-exception", name, time.time()),
                                      time.monotonic(), future))

    def _scan_dumps(self) -> None:
        """Dumps that appeared while nobody watched (the daemon down, an inotify overflow)."""
        try:
            found = dumpscan.scan(self.config.dumps, self.ingested)
        except OSError as exc:
            log.error("dump_scan_failed", dir=str(self.config.dumps), error=str(exc))
            return
        if found.busy:  # perhaps still being written: never ingest half a dump
            self.next_dump_scan = min(self.next_dump_scan, time.monotonic() + dumpscan.QUIET_S)
        for name in found.ready:
            self.guard("dump", self._dump_appeared, name)

    # -- reports kept while the state dir was full -------------------------

    def _flush_spool(self) -> None:
        """Reports kept while the state dir had no room: stored and indexed once it has."""
        pending = self.spool.pending()
        if pending:
            for incident_id in self.spool.flush(self.store):
                log.warning("incident_stored", incident=incident_id, from_spool=True)
                if self.fleet:  # the store's copy waited for the local one
                    meta = read_json_or_none(self.store.dir / incident_id / "incident.json") or {}
                    self.fleet.stored(incident_id, self.store.dir / incident_id, meta.get("job"), meta.get("job_incident"))
        self.metrics.incidents_pending.labels(**self.metrics.const).set(len(self.spool.pending()) if pending else 0)
