"""The daemon: one event loop that owns every watched process, and hands the slow work to workers.

The loop sleeps in ``select`` until something happens: a registration file
appears (inotify), a watched process exits (its pidfd), a worker posts a result
to the loop's one queue (``Inbox``), a signal arrives, or the earliest timer is
due (a process's heartbeat deadline, the rescan, systemd's watchdog). It never
blocks on what it watches: reads of /proc and of beat segments do not block,
and captures, samples and scans run on worker threads with their own deadlines.

Who owns what. The loop thread alone writes the ``Watchlist`` (every field that
decides a process's fate, through ``Watchlist.change`` and its table of legal
transitions). Workers get frozen records and post one frozen value back, from
a ``finally`` (their exceptions arrive as values):

    sampler (py-spy)        SampleTaken(process, native, sample | its error | deferred), PaceSampled(process, sample)
    pace's NVML look        GpusLooked(job, NVML's answer | its error)
    capture workers         CaptureLooked(capture, when its window has passed), CaptureDone(capture, incident | error),
                            ChoreDone(name, error)
    discovery thread        GpuPidsFound(pids)
    discovery's /proc scan  Discovered(registrations | error)
    fleet poller            CaptureRequest (another node's request for a job's ranks), PacesRead (other nodes' paces)
    flight-recorder warm-up WarmupDone(registration, outcome)
    NVML listener           GpusFound(gpus), GpuEvent (an XID)
    kernel log reader       GpuEvent (an NVRM Xid line, with its process)
    the store (any thread)  LedgerChanged(incident, entry) (the ledger of suspects)

Three threads keep to themselves and decide no process's fate: retention
(``incidents/retention.py``, its own schedule, told by the store what it
stored), the recorder of process exits (``host/proc_exits.py``, read by the
capture's ``exits`` step) and the sampler's quiet look (``detect/quiet.py``:
when each sampled process's threads last ran, read by the sampler).

``_dispatch`` hands each to its room; the state machine (``detect.machine``)
answers with decisions (``Declare``, ``Drop``) that ``_act`` carries out: a
capture queued on the workers, then the group HUNG (``handed_over``). One hang
read from start to end: ``_look`` -> ``machine.observe`` -> ``Declare`` ->
``_act`` -> ``workers.start`` -> ``CaptureLooked`` -> ``workers.resume`` ->
``CaptureDone`` -> ``_capture_done`` -> ``machine.stored``. The status writer gets plain data made here.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
from collections.abc import Sequence
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
from ..detect.machine import Decision, Declare, Drop, StateMachine, retry_pause
from ..detect.pace_machine import DeclareSlow
from ..detect.sampler import PaceSampled, SampleBatch, Sampler, SampleTaken
from ..detect.stack import BLOCKING, IDLE
from ..fleet.agent import Agent, CaptureRequest
from ..fleet.paces import PacesRead
from ..host import dump_fifos, procfs
from ..host.dump_fifos import ExceptionBegun, ExceptionDrained, ExceptionFifos
from ..host.gpu_events import GpuEvent, GpusFound
from ..host.notify import notify, watchdog_interval
from ..host.proc_exits import ProcExits, ProgramStarted
from ..host.user_limits import Budgets, UserLimits
from ..incidents import heal
from ..incidents.retention import Retention
from ..incidents.spool import SPOOL_DIR, Spool
from ..incidents.store import Store, StoreError, StoreWriteError
from ..metrics import Metrics, create, serve
from ..model import ProcessId, Registration, State, Suspicion
from ..watch.admission import Discovered, Registrations
from ..watch.discovery import Discovery, GpuPidsFound
from ..watch.stack_history import Sample
from ..watch.watched import LIVE, Watched, Watchlist
from ..workload import registration_file
from . import act, exception_dumps
from .capture_workers import CaptureDone, CaptureLooked, CaptureWorkers, ChoreDone
from .exception_capture import ExceptionLooked
from .fr_warmup import Warmup, WarmupDone
from .inbox import Inbox
from .instance_lock import AlreadyRunning, InstanceLock, LockDirError
from .loop_guard import Guard
from .node_health import LedgerChanged, NodeHealth, Suspicions
from .pace_room import GpusLooked, PaceRoom
from .status_file import STATUS_EVERY, WRITE_GAP, StatusFile

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
        self.inbox = Inbox()  # every worker's result comes back here, as a value
        post = self.inbox.post
        self.store = Store(cfg.state_dir, on_stored=self.retention.stored,
                           on_ledger=lambda incident, entry: post(LedgerChanged(incident, entry)))
        self.fleet = Agent(cfg.store, cfg.node, Path(cfg.state_dir), cfg.store_poll_interval, cfg.job_incident_window,
                           cfg.store_spool_max, post, self._count_sends, cfg.slow_publish_interval) if cfg.store else None
        self.status = StatusFile(Path(cfg.runtime_dir))
        self.watched = Watchlist(self.metrics, on_change=self._status_changed, limit=WATCH_MAX)
        self.status_dirty = False  # a state changed since status.json was last handed to its writer
        self.status_posted = 0.0  # when it was last handed over (at most once a WRITE_GAP)
        self.limits = UserLimits(cfg.max_registrations_per_uid, cfg.pyspy_samples_per_uid, budgets=Budgets(
            cfg.captures_per_uid, cfg.capture_seconds_per_uid, {"dump": cfg.dumps_per_uid_per_minute,
                                                                "incident": cfg.incidents_per_uid_per_minute,
                                                                "log": cfg.log_lines_per_uid_per_minute}))
        self.selector = selectors.DefaultSelector()
        self.guard = Guard(self.metrics)
        self.registrations = Registrations(cfg, self.watched, self.metrics, self.limits, self.selector, self.guard, post)
        self.spool = Spool(Path(cfg.runtime_dir) / SPOOL_DIR, cfg.spool_bytes_per_uid)  # reports kept while the state dir is full
        # Processes that end, with their signal; and programs started below a workload of hangwatchd run's,
        # each given its exception FIFO before its CUDA can fault (a torchrun rank, an engine's worker).
        self.exits = ProcExits(listen="exits" in cfg.capture_steps or cfg.exception_fifos,
                               on_exec=lambda pid, root: post(ProgramStarted(pid, root)))
        self.followed: dict[int, Registration] = {}  # pid -> the workload whose new programs get FIFOs
        # GPU exception dumps through a FIFO per process, the stacks taken while the driver waits (host/dump_fifos.py).
        self.fifos = ExceptionFifos(cfg.dumps, post, cfg.exception_dump_max_bytes) if cfg.exception_fifos else None
        self.workers = CaptureWorkers(cfg, self.store, self.spool, make_steps(cfg, self.exits, self.fifos), self.metrics,
                                      self.watched, self.registrations, self.fleet, post,
                                      act.Acting(Path(cfg.runtime_dir), cfg.on_hang, cfg.abort_grace, self.metrics,
                                                 cfg.abort_on_request), self.fifos)
        detector = HeartbeatDetector(cfg.startup_grace, cfg.learn_timeouts, cfg.learned_timeout_factor,
                                     cfg.learned_timeout_min, cfg.learned_timeout_max, int(cfg.learn_min_beats))
        self.machine = StateMachine(cfg, detector, self.watched, self.metrics,
                                    tuple(BLOCKING) + tuple(cfg.stack_blocking_patterns), cfg.stack_idle_pattern or IDLE,
                                    capture_budget=capture_budget(cfg))
        self.sampler = Sampler(cfg.pyspy_timeout, cfg.pyspy_samples_per_uid, self.limits, post)
        # Each job's pace, from its ranks' beats and low-rate samples: slow episodes (pace_room.py).
        self.pace = PaceRoom(cfg, self.watched, self.metrics, self.sampler, post, self.fleet) if cfg.slow_jobs else None
        self.to_sample: list[tuple[Registration, bool, Sample | None]] = []  # due this turn (``_start_samples``)
        self.lock = InstanceLock(Path(cfg.runtime_dir))
        self.state_lock = InstanceLock(Path(cfg.state_dir), "state dir", "--state-dir", says=str(cfg.runtime_dir))
        # GPU faults (XIDs) from the NVML listener's and the kernel log's threads; health.json written by the status writer's.
        self.node_health = NodeHealth(Path(cfg.runtime_dir), self.metrics, post, self.status.post_file,
                                      kernel_log=cfg.kernel_log, node=cfg.node, state_dir=Path(cfg.state_dir),
                                      suspicions=Suspicions(cfg.suspect_jobs, cfg.suspect_window))
        # New GPU processes within seconds, found on a thread of its own (watch/discovery.py).
        self.discovery = Discovery(cfg.discover_devices, cfg.discover_interval, post) if cfg.discover else None
        # Each rank's flight recorder asked as it starts, until PyTorch has named a trace's frames (fr_warmup.py).
        self.warmup = Warmup(post) if cfg.flight_recorder_warmup and "flight_recorder" in cfg.capture_steps else None
        self.rescan_due = False  # the inotify queue overflowed: events were lost
        self.next_dump_scan = float("inf")  # a scan found dumps still being written: look again then
        self.stopping = False
        self.metrics_address = ""

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
        # The hangs this node stored that still hang: adopted as captured when their processes register.
        try:
            self.registrations.captured_before = self.store.captured(procfs.boot_time(), procfs.alive)
        except StoreError as exc:
            log.error("captured_not_read", error=str(exc))
        self.spool.clear_partials()
        if self.fleet:
            self.fleet.start()
        registration_file.prepare_dirs(Path(cfg.runtime_dir))
        act.prepare(Path(cfg.runtime_dir))
        cfg.dumps.mkdir(parents=True, exist_ok=True)
        if os.stat(cfg.dumps).st_uid == os.geteuid():
            os.chmod(cfg.dumps, 0o1777)  # workloads of any user write their CUDA dumps here
        if self.fifos is not None:
            self.fifos.start()  # off (with one line logged) where the directory cannot be the daemon's
        self.inotify = INotify()
        self.reg_wd = self.inotify.add_watch(cfg.registrations, inflags.CLOSE_WRITE | inflags.MOVED_TO | inflags.CREATE
                                             | inflags.DELETE | inflags.MOVED_FROM)
        self.dump_wd = self.inotify.add_watch(cfg.dumps, inflags.CLOSE_WRITE | inflags.MOVED_TO)
        self.selector.register(self.inotify.fileno(), selectors.EVENT_READ, "inotify")
        self.selector.register(self.inbox.fileno(), selectors.EVENT_READ, "inbox")
        if cfg.metrics_address:
            self.metrics_address = serve(self.metrics.registry, cfg.metrics_address)
        self.metrics.info.labels(**self.metrics.const).info({"version": __version__})
        self.node_health.start()  # before daemon.json: a daemon that clients see running has its health file
        self.exits.start()  # as root on the host; elsewhere off, with one line saying why
        self.status.metrics_address = self.metrics_address
        self.status.write([])  # status.json exists whenever daemon.json does; its writer thread keeps it from here
        fifo = dump_fifos.pattern_for(self.fifos.root, "{uid}") if self.fifos is not None and self.fifos.on else None
        self.status.write_daemon(cfg.state_dir, cfg.dumps, self.metrics_address, fifo)  # last: clients find the daemon by it
        self.status.start()

    def stop(self, *_: object) -> None:
        self.stopping = True
        self.inbox.wake()  # a signal handler: no lock taken, one byte sent

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
            self.sampler.start_quiet()
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
            self.workers.shutdown()  # running captures end at their deadlines ...
            self.sampler.shutdown()
            if self.pace is not None:
                self.pace.shutdown()
            self._dispatch(time.monotonic(), only=(CaptureDone, ChoreDone))  # ... each finished one logged and counted
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
            if self.fifos is not None and self.fifos.on:
                self.fifos.stop()  # after the captures: none reads a FIFO any more
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
            timers = [next_rescan, next_status, next_spool, self.next_dump_scan, self.watched.next_due(),
                      self.workers.next_due()]
            if self.pace is not None:
                timers.append(self.pace.next_due())
            if self.status_dirty:
                timers.append(self.status_posted + WRITE_GAP)
            if ping_every:
                timers.append(next_ping)
            timeout = max(LOOP_TICK, min(timers) - now)
            events = self.selector.select(timeout)
            started = time.monotonic()
            cpu_started = time.thread_time()
            for key, _mask in events:
                if key.data == "inotify":
                    guard("inotify", self._on_inotify)
                elif isinstance(key.data, registration_file.ProcessId):
                    guard("exit", self.registrations.exited, key.data)
                    if self.followed.pop(key.data.pid, None) is not None:
                        self.exits.unfollow(key.data.pid)
            now = time.monotonic()
            self._dispatch(now)  # what the workers sent back
            self.workers.resume(now)  # captures whose window has passed, back to a worker
            self.workers.tell_fleet(now)
            for w in self.watched.due(now):
                if w.process in self.watched:  # not forgotten while handling an earlier one
                    self._look(w, now)
            if self.pace is not None:
                guard("pace", self._pace, now)
            self._start_samples()
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
            self._first_looks(now)
            if now >= next_spool:
                guard("spool", self.workers.flush_spool)
                next_spool = now + SPOOL_RETRY_EVERY
            if now >= next_status or (self.status_dirty and now >= self.status_posted + WRITE_GAP):
                guard("status", self._write_status, now)
                next_status = now + STATUS_EVERY
            if ping_every and now >= next_ping:
                if self.workers.healthy(now):  # the loop runs (we are in it), no capture is past its own deadline
                    notify("WATCHDOG=1")
                next_ping = now + ping_every
            self.metrics.loop_duration.labels(**self.metrics.const).observe(time.monotonic() - started)
            self.metrics.loop_cpu.labels(**self.metrics.const).inc(time.thread_time() - cpu_started)

    # -- what the workers sent back ----------------------------------------

    def _dispatch(self, now: float, only: tuple[type, ...] = (object,)) -> None:
        """Every value posted since the last turn, each to its room, in order (one's failure contained,
        logged and counted); then the processes they admitted get their first look. ``only``: the
        kinds still taken (stopping: what finished, not what would start more work)."""
        for message in self.inbox.drain():
            if isinstance(message, only):
                self.guard(type(message).__name__, self._deliver, message, now)
        self._first_looks(now)

    def _deliver(self, m: object, now: float) -> None:
        """The room that takes each kind of value a worker posts."""
        if isinstance(m, SampleTaken):
            self._sample_taken(m, now)
        elif isinstance(m, SampleBatch):
            for taken in m.taken:
                self.guard("SampleTaken", self._sample_taken, taken, now)
        elif isinstance(m, CaptureDone):
            self._capture_done(m, now)
        elif isinstance(m, CaptureLooked):
            self.workers.looked(m)
        elif isinstance(m, ChoreDone):
            self.workers.chore_done(m)
        elif isinstance(m, GpuPidsFound):
            self.metrics.passes.labels(**self.metrics.labels(what="discovery")).inc()
            if m.pids:
                self.registrations.discover(list(m.pids))
        elif isinstance(m, Discovered):
            self.registrations.discovered(m)
        elif isinstance(m, CaptureRequest):
            self._store_request(m, now)
        elif isinstance(m, WarmupDone):
            self._warmup_done(m)
        elif isinstance(m, GpusFound):
            self.node_health.gpus_found(m)
        elif isinstance(m, GpuEvent):
            self.node_health.gpu_event(m, *self._job_of(m))
        elif isinstance(m, PaceSampled):
            if self.pace is not None:
                self.pace.sampled(m)
        elif isinstance(m, GpusLooked):
            if self.pace is not None:
                self.pace.gpus_looked(m)
        elif isinstance(m, PacesRead):
            if self.pace is not None:
                self.pace.paces_read(m)
        elif isinstance(m, LedgerChanged):
            self.node_health.ledger_changed(m)
        elif isinstance(m, ProgramStarted):
            self._program_started(m)
        elif isinstance(m, ExceptionBegun):
            self._exception_begun(m, now)
        elif isinstance(m, ExceptionLooked):
            done = self.workers.exception_looked(m)
            if done is not None:
                self._capture_done(done, now)
        elif isinstance(m, ExceptionDrained):
            self.workers.exception_drained(m)
        else:  # a worker posted what nobody takes: a bug, never a silent loss
            raise TypeError(f"no room takes {type(m).__name__}")

    def _job_of(self, event: GpuEvent) -> tuple[str | None, int | None]:
        """The job and rank of the watched process an XID names (pid and start time), if it is one."""
        if event.pid is None or event.start_time is None:
            return None, None
        w = self.watched.get(ProcessId(event.pid, event.start_time))
        return (w.registration.job, w.registration.rank) if w is not None else (None, None)

    def _sample_taken(self, taken: SampleTaken, now: float) -> None:
        w = self.watched.get(taken.process)
        if w is None:
            return  # forgotten meanwhile
        if not procfs.alive(taken.process):
            self.watched.change(w, sampling=False)  # its exit is on its way (the pidfd)
            return
        try:
            self._act(self.machine.sample_taken(w, taken, now), now)
        except Exception:
            self.machine.backoff(w, now, "sample")
            raise

    def _capture_done(self, done: CaptureDone, now: float) -> None:
        pace = self.workers.pace_of(done)
        if pace is not None and self.pace is not None:
            self.pace.filed(pace, done.incident)
        for w, incident in self.workers.finished(done):
            if self.watched.get(w.process) is not w:
                continue  # gone meanwhile
            if incident is None:
                self.machine.capture_failed(w, now)
            else:
                self.machine.stored(w, incident)

    def _store_request(self, req: CaptureRequest, now: float) -> None:
        """Another node declared a job hung: capture this node's ranks of it now, whatever they look like here."""
        if self.fleet is None:
            return
        group = self.workers.requested_group(req, now)
        if group:
            why = Suspicion("job-request", f"node {req.node} declared job {req.job} hung ({req.reason}: {req.detail})", req.time)
            self._act(self.machine.declare(group, why, now, req.job_incident, requested=req.on_hang), now)

    def _program_started(self, started: ProgramStarted) -> None:
        """A program started below a workload of hangwatchd run's (a rank under torchrun, a worker process):
        its exception FIFO, as the workload's job's, unless it runs as another user (a setuid helper)."""
        root = self.followed.get(started.root)
        if root is None or self.watched.get(root.process) is None:
            self.followed.pop(started.root, None)
            self.exits.unfollow(started.root)
            return
        process, uid = procfs.identify(started.pid), procfs.uid(started.pid)
        if self.fifos is None or process is None or uid != root.uid or process in self.watched:
            return
        self.fifos.add(Registration(process, uid, job=root.job, source="below", registered_at=time.time()))

    def _exception_begun(self, begun: ExceptionBegun, now: float) -> None:
        """The driver began an exception's dump in a process's FIFO: captured now, alive. The process is
        HUNG from here (its beats have stopped: the exception is its one incident, never a second hang)."""
        w = self.watched.get(begun.registration.process)
        # Bytes that are no dump (its owner wrote into the FIFO) say nothing of the process's state.
        group = [w] if w is not None and w.state in LIVE and begun.coredump else []
        if self.workers.start_exception(begun, group) is None and group:
            why = Suspicion("gpu-exception", f"GPU exception: the driver began writing its dump into {begun.fifo}", begun.since)
            for d in self.machine.declare(group, why, now):
                if isinstance(d, Declare):
                    self.machine.handed_over(d, None, now)

    @staticmethod
    def _warmup_done(done: WarmupDone) -> None:
        r = done.registration
        if done.outcome == "warmed":
            log.info("flight_recorder_warmed", pid=r.process.pid, job=r.job, rank=r.rank,
                     seconds_after_watched=round(done.seconds_after_watched, 2))
        else:
            log.warning("flight_recorder_warmup_failed", pid=r.process.pid, job=r.job, rank=r.rank, error=done.outcome)

    # -- the state machine's decisions, carried out -------------------------

    def _act(self, decisions: Sequence[Decision | DeclareSlow], now: float) -> None:
        for d in decisions:
            if isinstance(d, Declare):
                try:  # the transaction: the capture queued (or why not), then the group HUNG
                    refused = self.workers.start(d)
                except Exception as exc:  # whatever failed, the hang is captured again later
                    log.exception("capture_not_queued", pids=[x.process.pid for x in d.group], retry_in=retry_pause(1),
                                  error=f"{type(exc).__name__}: {exc}")
                    refused = f"{type(exc).__name__}: {exc}"
                self.machine.handed_over(d, refused, now)
            elif isinstance(d, Drop):
                self.registrations.tampered(d.watched, d.refused)
            elif isinstance(d, DeclareSlow) and self.pace is not None:
                try:  # a slow episode is filed once: what could not be queued is said, not tried again
                    refused = self.workers.start_slow(d)
                except Exception as exc:  # noqa: BLE001 - said, and counted as the loop's error by the guard's caller
                    refused = f"{type(exc).__name__}: {exc}"
                self.pace.handed_over(d, refused)

    def _look(self, w: Watched, now: float) -> None:
        """A process is due: its detector's look, then its stack sample, each contained."""
        if w.next_check <= now and not self.guard("observe", self._observe, w, now, pid=w.process.pid):
            self.machine.backoff(w, now, "observe")
        if w.process not in self.watched:
            return  # dropped for a tampered file
        if w.next_sample <= now and not w.sampling and not self.guard("sample", self._sample, w, now, pid=w.process.pid):
            self.machine.backoff(w, now, "sample")
        if w.process in self.watched and w.next_check <= now:
            self.machine.backoff(w, now, "observe")  # its look left no timer (a bug): never lose a process

    def _pace(self, now: float) -> None:
        assert self.pace is not None
        self._act(self.pace.run(now), now)

    def _observe(self, w: Watched, now: float) -> None:
        self._act(self.machine.observe(w, now), now)

    def _sample(self, w: Watched, now: float) -> None:
        """Its sample is due: started with the others due this turn (``_start_samples``)."""
        native = w.state is State.SUSPECT and w.suspicion is not None and w.suspicion.reason == "stack"
        last = w.history.samples[-1] if w.history.samples and not native else None
        self.to_sample.append((w.registration, native, last))
        self.watched.change(w, sampling=True)  # until its SampleTaken comes back, which it always does

    def _start_samples(self) -> None:
        """The samples due this turn, handed to the sampler at once: those it carries come back together."""
        batch, self.to_sample = self.to_sample, []
        if not batch:
            return
        try:
            self.sampler.start_many(batch)
        except Exception as exc:  # none started: each is sampled again after a pause, never left "sampling"
            log.exception("samples_not_started", count=len(batch), error=f"{type(exc).__name__}: {exc}")
            now = time.monotonic()
            for reg, _native, _last in batch:
                w = self.watched.get(reg.process)
                if w is not None:
                    self.watched.change(w, sampling=False)
                    self.machine.backoff(w, now, "sample")

    def _first_looks(self, now: float) -> None:
        """Processes admitted since the last turn: the detectors' first look, and the flight-recorder warm-up."""
        for w in self.registrations.take_arrived():
            if self.watched.get(w.process) is not w:
                continue
            if not self.guard("observe", self._observe, w, now, pid=w.process.pid):
                self.machine.backoff(w, now, "observe")
            if self.warmup is not None:
                self.warmup.add(w.registration)
            if self.fifos is not None and self.fifos.on and w.registration.source != "discovered":
                self.fifos.add(w.registration)  # before CUDA can fault: hangwatchd run's child waits for it
                if w.registration.source == "run" and self.exits.on:
                    self.followed[w.process.pid] = w.registration
                    self.exits.follow(w.process.pid)

    def rescan(self) -> None:
        self.registrations.rescan()
        self.metrics.passes.labels(**self.metrics.labels(what="rescan")).inc()

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

    def _status_changed(self) -> None:
        self.status_dirty = True

    def _write_status(self, now: float) -> None:
        """Hand the status writer plain data made here (it writes off the loop, at most once a WRITE_GAP)."""
        self.status_dirty = False
        self.status_posted = now
        wall = time.time()
        self.status.post([(w.status_row(now, wall), w.registration) for w in self.watched.values()])
        self.node_health.expire(wall)  # the ledger's window moves on: a GPU implicated a day ago is cleared

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
