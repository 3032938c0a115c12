"""The daemon: one event loop that hands the work of each stage to its room.

The loop sleeps in ``select`` until something happens: a registration file
appears (inotify), a watched process exits (its pidfd), a capture or a stack
sample finishes (a wake-up pipe), a signal arrives, or the earliest timer is
due (a process's heartbeat deadline, the rescan, systemd's watchdog). It never
blocks on what it watches: reads of /proc and of beat segments do not block,
and captures and samples run on worker threads with their own deadlines.

Who does what: ``registrations`` admits and forgets processes, ``detect``
judges them (``machine``, with stack samples from ``sampler``),
``capture_workers`` runs each hang through ``make_incident`` (capture,
analyse, store) and each exception dump through ``dump_ingest`` on worker
threads, ``retention`` keeps the store to its limits (on a thread of its own,
told by the store what it stored) and ``status_file`` says what is watched.
The loop owns the ``Watchlist`` and calls them in turn.
"""

from __future__ import annotations

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

from .. import __version__
from ..capture import capture_budget, make_steps
from ..config import Config
from ..cudacore import sandbox
from ..detect import HeartbeatDetector
from ..detect.machine import StateMachine
from ..detect.sampler import Sampler
from ..detect.stack import BLOCKING, IDLE
from ..fleet.agent import Agent
from ..host.notify import notify, watchdog_interval
from ..host.proc_exits import ProcExits
from ..host.user_limits import Budgets, UserLimits
from ..incidents import heal
from ..incidents.retention import Retention
from ..incidents.spool import SPOOL_DIR, Spool
from ..incidents.store import Store, StoreWriteError
from ..metrics import Metrics, create, serve
from ..watch.admission import Registrations
from ..watch.discovery import Discovery
from ..watch.watched import Watched, Watchlist
from ..workload import registration_file
from . import act, exception_dumps
from .capture_workers import CaptureWorkers
from .fr_warmup import Warmup
from .instance_lock import AlreadyRunning, InstanceLock, LockDirError
from .loop_guard import Guard
from .node_health import NodeHealth
from .status_file import STATUS_EVERY, StatusFile

log = structlog.get_logger("hangwatchd.daemon")

SPOOL_RETRY_EVERY = 5.0  # how soon a report kept in the spool is tried again once the state dir has room
LOOP_TICK = 0.05  # seconds: timers due within this are handled together (1,000 processes' timers cost one wake-up, not 1,000)
WATCH_MAX = 10_000  # processes watched at once, all users together (each user is held to max_registrations_per_uid)


class SetupError(Exception):
    """The daemon cannot start here: one line saying what and where."""


@dataclass
class Daemon:
    config: Config
    metrics: Metrics = field(default=None)  # type: ignore[assignment]  # made with the node's name below

    def __post_init__(self) -> None:
        cfg = self.config
        self.metrics = self.metrics or create(node=cfg.node)
        self.retention = Retention(cfg)  # its own thread and schedule; the store tells it what it stored
        self.store = Store(cfg.state_dir, on_stored=self.retention.stored)
        self.fleet = Agent(cfg.store, cfg.node, Path(cfg.state_dir), cfg.store_poll_interval, cfg.job_incident_window,
                           cfg.store_spool_max, self._wake, self._count_sends) if cfg.store else None
        self.status = StatusFile(Path(cfg.runtime_dir))
        self.watched = Watchlist(self.metrics, on_change=self._status_changed, limit=WATCH_MAX)
        self.status_dirty = False  # a state changed since status.json was last handed to its writer
        self.limits = UserLimits(cfg.max_registrations_per_uid, cfg.pyspy_samples_per_uid, budgets=Budgets(
            cfg.captures_per_uid, cfg.capture_seconds_per_uid, {"dump": cfg.dumps_per_uid_per_minute,
                                                                "incident": cfg.incidents_per_uid_per_minute,
                                                                "log": cfg.log_lines_per_uid_per_minute}))
        self.selector = selectors.DefaultSelector()
        self.guard = Guard(self.metrics)
        self.registrations = Registrations(cfg, self.watched, self.metrics, self.limits,
                                           attach=lambda fd, p: self.selector.register(fd, selectors.EVENT_READ, p),
                                           detach=self.selector.unregister, first_look=self._first_look, guard=self.guard,
                                           wake=self._wake)
        self.spool = Spool(Path(cfg.runtime_dir) / SPOOL_DIR, cfg.spool_bytes_per_uid)  # reports kept while the state dir is full
        self.exits = ProcExits(listen="exits" in cfg.capture_steps)  # processes that end, with their signal
        self.workers = CaptureWorkers(cfg, self.store, self.spool, make_steps(cfg, self.exits), self.metrics,
                                      self.watched, self.registrations, self.fleet, self._wake)
        detector = HeartbeatDetector(cfg.startup_grace, cfg.learn_timeouts, cfg.learned_timeout_factor,
                                     cfg.learned_timeout_min, cfg.learned_timeout_max, int(cfg.learn_min_beats))
        self.machine = StateMachine(cfg, detector, self.watched, self.metrics,
                                    tuple(BLOCKING) + tuple(cfg.stack_blocking_patterns), cfg.stack_idle_pattern or IDLE,
                                    on_hung=self.workers.on_hung, on_tampered=self.registrations.tampered,
                                    capture_budget=capture_budget(cfg))
        self.workers.machine = self.machine
        self.workers.act = act.Acting(Path(cfg.runtime_dir), cfg.on_hang, cfg.abort_grace, self.metrics, cfg.abort_on_request)
        self.sampler = Sampler(cfg.pyspy_timeout, cfg.pyspy_samples_per_uid, self.limits, self._wake, self.metrics)
        self.lock = InstanceLock(Path(cfg.runtime_dir))
        self.state_lock = InstanceLock(Path(cfg.state_dir), "state dir", "--state-dir", says=str(cfg.runtime_dir))
        self.node_health = NodeHealth(Path(cfg.runtime_dir), self.metrics)  # GPU faults (XIDs), health.json
        # New GPU processes within seconds, found on a thread of its own (watch/discovery.py).
        self.discovery = Discovery(cfg.discover_devices, cfg.discover_interval, self._wake) if cfg.discover else None
        # Each rank's flight recorder asked as it starts, until PyTorch has named a trace's frames (fr_warmup.py).
        self.warmup = Warmup() if cfg.flight_recorder_warmup and "flight_recorder" in cfg.capture_steps else None
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
        except (AlreadyRunning, LockDirError) as exc:
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
        unlocked = self.state_lock.acquire()  # and one daemon per state dir, whatever its runtime dir
        if unlocked:
            log.error("state_dir_not_locked", error=unlocked)
        full = heal.open_healed(self.store, self.metrics, lambda: self.stopping)  # a corrupt or lost index rebuilt
        if full:
            log.error("store_write_failed", error=full)
        sandbox.configure(sandbox.Limits(cfg.symbolize_cpu_seconds, int(cfg.symbolize_memory_mb), cfg.symbolize_timeout))
        sandbox.start()  # warm before the first dump arrives
        try:
            for incident_id in self.store.recover():
                log.warning("incident_recovered", incident=incident_id)
        except StoreWriteError as exc:
            log.error("recover_deferred", error=str(exc))
        # Only names still in the dump dir matter (an ingested dump is moved into its incident).
        try:
            present = set(os.listdir(cfg.dumps))
        except OSError:
            present = set()
        self.workers.remember_ingested(self.store.ingested() & present)
        self.spool.clear_partials()
        if self.fleet:
            self.fleet.start()
        registration_file.prepare_dirs(Path(cfg.runtime_dir))
        act.prepare(Path(cfg.runtime_dir))
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
        self.metrics.info.labels(**self.metrics.const).info({"version": __version__})
        self.node_health.start()  # before daemon.json: a daemon that clients see running has its health file
        self.exits.start()  # as root on the host; elsewhere off, with one line saying why
        self.status.metrics_address = self.metrics_address
        self.status.write([])  # status.json exists whenever daemon.json does; its writer thread keeps it from here
        self.status.write_daemon(cfg.state_dir, cfg.dumps, self.metrics_address)  # last: clients find the daemon by it
        self.status.start()

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
        # SIGHUP stops cleanly like SIGTERM (README: Signals): a config reload would have to
        # re-judge every watched process under new timeouts; a restart does that plainly. Caught
        # before prepare() writes daemon.json: a client that found the daemon may signal it at once.
        old = {s: signal.signal(s, self.stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            self.prepare()
        except BaseException:
            for s, h in old.items():
                signal.signal(s, h)
            raise
        try:
            self.retention.start()  # after prepare: a daemon that cannot start removes nothing
            self.workers.flush_spool()
            self.rescan()
            self._scan_dumps()
            if self.discovery is not None:
                self.discovery.start()  # after the first full scan: what runs now is known
            if self.warmup is not None:
                self.warmup.start()
            notify("READY=1")
            self.status.say(f"watching {len(self.watched)} processes")
            log.info("daemon_ready", state_dir=self.config.state_dir, runtime_dir=self.config.runtime_dir,
                     metrics=self.metrics_address, pid=os.getpid())
            self.loop()
        finally:
            self.retention.stop()  # a pass under way notices within a second
            self.status.stop()  # its thread says nothing after STOPPING=1
            notify("STOPPING=1")
            log.info("daemon_stopping", captures_in_flight=len(self.workers.captures))
            self.registrations.stop()
            self.workers.shutdown()  # running captures end at their deadlines; each finished one is logged and counted
            self.sampler.shutdown()
            if self.workers.act:
                self.workers.act.stop()
            if self.discovery is not None:
                self.discovery.stop()
            if self.warmup is not None:
                self.warmup.stop()
            if self.fleet:
                self.fleet.stop()
            for s, h in old.items():
                signal.signal(s, h)
            sandbox.stop()  # the symboliser's helpers and their temporary directory, before systemd kills them
            self.status.remove()
            self.node_health.stop()
            self.exits.stop()
            self.state_lock.release()
            self.lock.release()
        return 0

    # -- the loop --------------------------------------------------------

    def loop(self) -> None:
        now = time.monotonic()
        next_rescan = now + self.config.rescan_interval
        ping_every = watchdog_interval()
        next_ping = now
        next_status = now
        next_spool = now + SPOOL_RETRY_EVERY
        guard = self.guard
        while not self.stopping:
            now = time.monotonic()
            timers = [next_rescan, next_status, next_spool, self.next_dump_scan, self.watched.next_due()]
            if ping_every:
                timers.append(next_ping)
            timeout = max(LOOP_TICK, min(timers) - now)
            events = self.selector.select(timeout)
            started = time.monotonic()
            cpu_started = time.thread_time()
            for key, _mask in events:
                if key.data == "inotify":
                    guard("inotify", self._on_inotify)
                elif key.data == "wake":
                    self._drain_wake()
                elif isinstance(key.data, registration_file.ProcessId):
                    guard("exit", self.registrations.exited, key.data)
            now = time.monotonic()
            self.workers.collect()
            if self.discovery is not None:
                found = self.discovery.take()
                if found:
                    guard("discover", self.registrations.discover, found)
            self.workers.serve_requests()
            guard("discovery", self.registrations.discovered)
            for w, sample, native in self.sampler.ready(self.watched):
                if not guard("judge_stack", self.machine.judge_stack, w, sample, native, now, pid=w.process.pid):
                    self.machine.backoff(w, now, "sample")
            for w in self.watched.due(now):
                if w.process not in self.watched:
                    continue  # forgotten while handling an earlier one
                if w.next_check <= now and not guard("observe", self.machine.observe, w, now, pid=w.process.pid):
                    self.machine.backoff(w, now, "observe")
                if w.process not in self.watched:
                    continue  # dropped for a tampered file
                if w.next_sample <= now and not w.sampling and not guard("sample", self._sample, w, now, pid=w.process.pid):
                    self.machine.backoff(w, now, "sample")
                if w.process in self.watched and w.next_check <= now:
                    self.machine.backoff(w, now, "observe")  # its look left no timer (a bug): never lose a process
            if now >= self.next_dump_scan:
                self.next_dump_scan = float("inf")
                guard("scan_dumps", self._scan_dumps)
            if now >= next_rescan or self.rescan_due:
                if self.rescan_due:
                    guard("scan_dumps", self._scan_dumps)
                self.rescan_due = False
                guard("rescan", self.rescan)
                self.watched.reschedule_all()  # the safety net under the timer heap, as the rescan is under inotify
                next_rescan = now + self.config.rescan_interval
            if now >= next_spool:
                guard("spool", self.workers.flush_spool)
                next_spool = now + SPOOL_RETRY_EVERY
            if now >= next_status or self.status_dirty:
                guard("status", self._write_status)
                next_status = now + STATUS_EVERY
            if ping_every and now >= next_ping:
                if self.workers.healthy(now):  # the loop runs (we are in it), no capture is past its own deadline
                    notify("WATCHDOG=1")
                next_ping = now + ping_every
            self.metrics.loop_duration.labels(**self.metrics.const).observe(time.monotonic() - started)
            self.metrics.loop_cpu.labels(**self.metrics.const).inc(time.thread_time() - cpu_started)

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
                self.guard("inotify_event", self.workers.dump_appeared, name)
            else:
                self.guard("inotify_event", self.registrations.changed, name, event.mask)

    def _first_look(self, w: Watched, now: float) -> None:
        self.machine.observe(w, now)
        if self.warmup is not None:
            self.warmup.add(w.registration)

    def _status_changed(self) -> None:
        self.status_dirty = True

    def _write_status(self) -> None:
        """Hand a snapshot to the status writer: it writes off the loop, at most once a second."""
        self.status_dirty = False
        self.status.post(list(self.watched.values()))

    def _sample(self, w: Watched, now: float) -> None:
        again = self.sampler.sample(w, now)
        if again is not None:
            self.watched.change(w, sample_at=again)

    def _scan_dumps(self) -> None:
        """Dumps that appeared while nobody watched (the daemon down, an inotify overflow)."""
        try:
            found = exception_dumps.scan(self.config.dumps, self.workers.ingested)
        except OSError as exc:
            log.error("dump_scan_failed", dir=str(self.config.dumps), error=str(exc))
            return
        if found.busy:  # perhaps still being written: never ingest half a dump
            self.next_dump_scan = min(self.next_dump_scan, time.monotonic() + exception_dumps.QUIET_S)
        for name in found.ready:
            self.guard("dump", self.workers.dump_appeared, name)

    def _count_sends(self, outcome: str, spooled: int) -> None:  # on the uploader's thread
        self.metrics.store_sends.labels(**self.metrics.labels(outcome=outcome)).inc()
        self.metrics.store_spooled.labels(**self.metrics.const).set(spooled)
