"""The daemon: one event loop that ties registration, detection, capture and the store together.

The loop sleeps in ``select`` until something happens: a registration file
appears (inotify), a watched process exits (its pidfd), a capture finishes
(a wake-up pipe), a signal arrives, or the earliest timer is due (a process's
heartbeat deadline, the rescan, systemd's watchdog). It never blocks on what
it watches: reads of /proc and of beat segments do not block, and captures
run on worker threads with their own deadlines.
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import re
import os
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from inotify_simple import INotify
from inotify_simple import flags as inflags

from . import __version__, dump_ingest, dumpscan, exits, gpudump, procfs, ranks, registry, untrusted
from .detect import rearm
from .instance_lock import AlreadyRunning, InstanceLock
from .spool import SPOOL_DIR, Spool
from .analyze.stacks import gpu_wait
from .cudacore import sandbox
from .runtime import DAEMON_FILE, STATUS_FILE, write_json
from .capture import capture_incident, make_steps
from .config import Config
from .detect import HeartbeatDetector
from .detect.stack import BLOCKING, IDLE, classify, take_sample
from .fleet.agent import Agent
from .metrics import Metrics, create, serve
from .model import Registration, State, Suspicion
from .notify import notify, watchdog_interval
from .registry import RegistrationError, Watched
from .report import html
from .samples import Sample
from .store import Store, StoreWriteError
from .user_limits import UserLimits

log = structlog.get_logger("hangwatchd.daemon")

STATUS_EVERY = 2.0
RETENTION_EVERY = 600.0
CLOCK_SKEW = 30.0  # seconds two nodes' clocks may differ by, comparing one's request to the other's registrations
SPOOL_RETRY_EVERY = 5.0  # how soon a report kept in the spool is tried again once the state dir has room
ERROR_BACKOFF = 5.0  # a process whose handling raised is looked at again after this, not at once


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
    watched: dict[registry.ProcessId, Watched] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = self.metrics or create(node=self.config.node)
        self.store = Store(self.config.state_dir, pages=html.pages)
        cfg = self.config
        self.fleet = Agent(cfg.store, cfg.node, Path(cfg.state_dir), cfg.store_poll_interval, cfg.job_incident_window,
                           cfg.store_spool_max, self._wake, self._count_sends) if cfg.store else None
        cfg = self.config
        self.detector = HeartbeatDetector(cfg.startup_grace, cfg.learn_timeouts, cfg.learned_timeout_factor,
                                          cfg.learned_timeout_min, cfg.learned_timeout_max, int(cfg.learn_min_beats))
        self.blocking = tuple(BLOCKING) + tuple(cfg.stack_blocking_patterns)
        self.idle = cfg.stack_idle_pattern or IDLE
        self.sampler = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="sample")
        self.samples: queue.SimpleQueue[tuple[registry.ProcessId, Sample, bool]] = queue.SimpleQueue()
        self.steps = make_steps(self.config)
        self.selector = selectors.DefaultSelector()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="capture")
        self.captures: list[_Capture] = []
        self.refused: dict[str, float] = {}  # registration name -> mtime already refused (no log spam)
        self.limits = UserLimits(cfg.max_registrations_per_uid, cfg.pyspy_samples_per_uid)
        self.over_limit: set[str] = set()  # registrations waiting for their user to drop under the limit
        self.dumping: set[int] = set()  # pids whose GPU dump a capture is taking: not exception dumps
        self.ingested: set[str] = set()  # dump files already made into incidents
        self.recent: dict[int, tuple[Registration, float]] = {}  # exited processes, to link late dumps
        self.marks: dict[registry.ProcessId, rearm.ProgressMark] = {}  # where each captured process stood
        self.spool = Spool(Path(self.config.runtime_dir) / SPOOL_DIR)
        self.lock = InstanceLock(Path(self.config.runtime_dir))
        self.rescan_due = False  # the inotify queue overflowed: events were lost
        self.next_dump_scan = float("inf")  # a scan found dumps still being written: look again then
        self.departures = exits.Departures(Path(cfg.runtime_dir), cfg.exited_keep)  # for job-mates' incidents
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
        me = procfs.identify(os.getpid())
        self._write_json(Path(cfg.runtime_dir) / DAEMON_FILE, {
            "pid": os.getpid(), "start_time": me.start_time if me else None, "version": __version__,
            "state_dir": cfg.state_dir, "dump_dir": str(cfg.dumps), "metrics_address": self.metrics_address,
        })

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
            self._status(f"watching {len(self.watched)} processes")
            log.info("daemon_ready", state_dir=self.config.state_dir, runtime_dir=self.config.runtime_dir,
                     metrics=self.metrics_address, pid=os.getpid())
            self.loop()
        finally:
            notify("STOPPING=1")
            log.info("daemon_stopping", captures_in_flight=len(self.captures))
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.sampler.shutdown(wait=True, cancel_futures=True)
            if self.fleet:
                self.fleet.stop()
            for s, h in old.items():
                signal.signal(s, h)
            for name in (DAEMON_FILE, STATUS_FILE):
                (Path(self.config.runtime_dir) / name).unlink(missing_ok=True)
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
                    self._guarded("inotify", self._on_inotify)
                elif key.data == "wake":
                    self._drain_wake()
                elif isinstance(key.data, registry.ProcessId):
                    self._guarded("exit", self._on_exit, key.data)
            now = time.monotonic()
            self._collect_captures()
            self._serve_requests()
            self._collect_samples(now)
            for w in list(self.watched.values()):
                if w.process not in self.watched:
                    continue  # forgotten while handling an earlier one
                if w.next_check <= now and not self._guarded("observe", self._observe, w, now, pid=w.process.pid):
                    w.next_check = now + ERROR_BACKOFF
                if w.process not in self.watched:
                    continue  # dropped for a tampered file
                if w.next_sample <= now and not w.sampling and not self._guarded("sample", self._sample, w, now, pid=w.process.pid):
                    w.next_sample = now + ERROR_BACKOFF
            if now >= self.next_dump_scan:
                self.next_dump_scan = float("inf")
                self._guarded("scan_dumps", self._scan_dumps)
            if now >= next_rescan or self.rescan_due:
                if self.rescan_due:
                    self._guarded("scan_dumps", self._scan_dumps)
                self.rescan_due = False
                self._guarded("rescan", self.rescan)
                next_rescan = now + self.config.rescan_interval
            if now >= next_spool:
                self._guarded("spool", self._flush_spool)
                next_spool = now + SPOOL_RETRY_EVERY
            if now >= next_status:
                self._guarded("status", self._write_status)
                next_status = now + STATUS_EVERY
            if now >= next_retention and not self.captures:
                self.pool.submit(self._retention)
                next_retention = now + RETENTION_EVERY
            if ping_every and now >= next_ping:
                if self._healthy(now):
                    notify("WATCHDOG=1")
                next_ping = now + ping_every
            self.metrics.loop_duration.labels(**self.metrics.const).observe(time.monotonic() - started)

    def _guarded(self, where: str, fn: Any, *args: Any, pid: int | None = None) -> bool:
        """Run one piece of the loop's work; an exception is logged and counted, and the loop goes on."""
        try:
            fn(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - one process's, file's or dump's trouble never stops the loop
            self.metrics.loop_errors.labels(**self.metrics.labels(where=where)).inc()
            log.exception("loop_error", where=where, pid=pid, error=f"{type(exc).__name__}: {exc}")
            return False

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

    # -- registrations ---------------------------------------------------

    def _on_inotify(self) -> None:
        for event in self.inotify.read(timeout=0):
            if event.mask & inflags.Q_OVERFLOW:
                # Events were dropped: registrations and dumps may have come and gone unseen.
                log.warning("inotify_overflow", action="rescanning registrations and dumps")
                self.rescan_due = True
                continue
            self._guarded("inotify_event", self._on_event, event)

    def _on_event(self, event: Any) -> None:
        name = event.name
        if not name or name.startswith("."):
            return
        if event.wd == self.dump_wd:
            self._dump_appeared(name)
            return
        path = self.config.registrations / name
        if event.mask & (inflags.DELETE | inflags.MOVED_FROM):
            self._unregistered(name)
        elif event.mask & inflags.CREATE:
            # A regular file is read at CLOSE_WRITE, once complete; a symlink or
            # directory never gets one, so it is judged (and refused) now.
            if path.is_symlink() or path.is_dir():
                self._consider(path)
        else:
            self._consider(path)

    def rescan(self) -> None:
        """The safety net under inotify: pick up anything missed, drop what vanished."""
        try:
            names = {p.name for p in self.config.registrations.iterdir() if not p.name.startswith(".")}
        except OSError as exc:
            log.error("rescan_failed", dir=str(self.config.registrations), error=str(exc))
            return
        for name in names:
            self._guarded("registration", self._consider, self.config.registrations / name)
        for pid_key, w in list(self.watched.items()):
            if w.registration.source != "discovered" and registry.file_name(pid_key) not in names:
                self._unregistered(registry.file_name(pid_key))
        exits.remove_stale(Path(self.config.runtime_dir), time.time() - self.config.exited_keep)
        self.refused = {k: v for k, v in self.refused.items() if k in names}
        self.over_limit &= names
        if self.config.discover:
            self._discover()

    def _consider(self, path: Path) -> None:
        try:
            mtime = path.lstat().st_mtime
        except OSError:
            return
        if self.refused.get(path.name) == mtime:
            return
        try:
            reg = registry.load(path, self.config.beats)
        except RegistrationError as exc:
            self.refused[path.name] = mtime
            self.metrics.registration_errors.labels(**self.metrics.labels(reason=exc.reason)).inc()
            log.warning("registration_refused", file=str(path), reason=exc.reason, error=str(exc))
            return
        old = self.watched.get(reg.process)
        if old is not None:
            if old.registration.source != "discovered":
                return
            self._forget(old, "registered")  # a registration says more than discovery
        over = self.limits.over_registrations(reg.uid, (x.registration.uid for x in self.watched.values()
                                                          if x.registration.source != "discovered"))
        if over:
            self._refuse(path.name, "uid_limit", over, reg.uid)
            return
        self.over_limit.discard(path.name)
        self.limits.clear("uid_limit", reg.uid)
        self._watch(reg)

    def _refuse(self, name: str, reason: str, why: str, uid: int) -> None:
        """A registration over its user's limit: counted once per file, logged once per user.
        Not remembered as refused: it is admitted at a later rescan once the user is under the limit."""
        if name not in self.over_limit:
            self.over_limit.add(name)
            self.metrics.registration_errors.labels(**self.metrics.labels(reason=reason)).inc()
        if self.limits.first(reason, uid):
            log.warning("registration_refused", file=name, reason=reason, uid=uid, error=why)

    def _watch(self, reg: Registration) -> None:
        try:
            pidfd = os.pidfd_open(reg.process.pid)
        except OSError:
            return  # gone already
        if not procfs.alive(reg.process):  # the pid was reused between load and pidfd_open
            os.close(pidfd)
            return
        now = time.monotonic()
        timeout = reg.heartbeat_timeout or self.config.heartbeat_timeout
        source = "registration" if reg.heartbeat_timeout else "config"
        state = State.STARTING if reg.beat_file else State.HEALTHY
        w = Watched(reg, state, seen_at=now, timeout=timeout, next_check=now, timeout_source=source,
                    stack_timeout=reg.stack_timeout or self._stack_timeout_for(reg), role=reg.role)
        launcher = ranks.launcher_of(w, self.watched.values())
        if launcher is not None and launcher.role != "launcher":
            launcher.role = "launcher"
            log.info("launcher_found", pid=launcher.process.pid, rank_pid=reg.process.pid, job=reg.job)
        if ranks.ranks_below(w, self.watched.values()):
            w.role = "launcher"
        self.watched[reg.process] = w
        self.selector.register(pidfd, selectors.EVENT_READ, reg.process)
        w.pidfd = pidfd
        if w.watched_by_stack:
            w.next_sample = now
        log.info("process_registered", pid=reg.process.pid, job=reg.job, rank=reg.rank, timeout=timeout,
                 stack_timeout=w.stack_timeout, source=reg.source, cmdline=" ".join(reg.cmdline)[:200])
        self._set_state(w, state)
        self._observe(w, now)

    def _stack_timeout_for(self, reg: Registration) -> float | None:
        command = " ".join(reg.cmdline)
        for pattern, seconds in self.config.stack_timeouts.items():
            if re.search(pattern, command):
                return float(seconds)
        return None

    def _discover(self) -> None:
        """Every process holding /dev/nvidia* open, watched by its stack (a sidecar's view of the pod)."""
        known = {p.pid for p in self.watched} | {os.getpid()}
        for pid in procfs.gpu_processes():
            if pid in known:
                continue
            reg = registry.from_proc(pid, source="discovered")
            if reg is not None:
                self._watch(reg)

    def _unregistered(self, name: str) -> None:
        for key, w in list(self.watched.items()):
            if registry.file_name(key) == name:
                gone = not procfs.alive(key) or exits.read(Path(self.config.runtime_dir), key, w.registration.uid)
                if gone:  # removed at (or by its launcher after) its exit, before the pidfd was read
                    self._on_exit(key)
                else:
                    self._forget(w, "unregistered")

    def _on_exit(self, process: registry.ProcessId) -> None:
        w = self.watched.get(process)
        if w is not None:
            now = time.monotonic()
            self.recent = {pid: v for pid, v in self.recent.items() if now - v[1] < 600}
            self.recent[process.pid] = (w.registration, now)
            if w.role != "launcher":
                self.departures.add(exits.departed_from(w, time.time()))
            self._forget(w, "exited")
            registry.remove(self.config.registrations, process)
            if w.registration.beat_file:
                try:
                    Path(w.registration.beat_file).unlink(missing_ok=True)
                except OSError:
                    pass  # swapped for a directory: the user's to clean up

    def _forget(self, w: Watched, why: str) -> None:
        self._set_state(w, State.EXITED)
        log.info("process_forgotten", pid=w.process.pid, why=why, job=w.registration.job, rank=w.registration.rank)
        pidfd = w.pidfd
        if pidfd is not None:
            self.selector.unregister(pidfd)
            os.close(pidfd)
        del self.watched[w.process]
        r = w.registration
        try:
            self.metrics.last_beat.remove(*self.metrics.const.values(), r.job or "", str(r.rank if r.rank is not None else ""), str(r.process.pid))
            self.metrics.timeout.remove(*self.metrics.const.values(), r.job or "", str(r.rank if r.rank is not None else ""), str(r.process.pid))
        except KeyError:
            pass
        self._count_states()
        self._write_status()

    # -- detection -------------------------------------------------------

    def _observe(self, w: Watched, now: float) -> None:
        try:
            w.check_files()
            obs = self.detector.observe(w, now)
        except untrusted.Refused as exc:
            self._tampered(w, exc)
            return
        w.next_check = obs.next_check
        r = w.registration
        labels = self.metrics.labels(job=r.job or "", rank=str(r.rank if r.rank is not None else ""), pid=str(r.process.pid))
        self.metrics.timeout.labels(**labels).set(w.timeout)
        if w.beat is not None and w.beat.count:
            self.metrics.last_beat.labels(**labels).set(w.beat.wall_time() or 0)
        if w.state in (State.HUNG, State.CAPTURED):
            if w.state is State.CAPTURED and self._rearm_if_progressed(w):
                pass
            else:
                w.next_check = now + min(w.timeout, 5.0)  # look again later in case it recovers
            return
        if obs.state is State.SUSPECT:
            if w.state is not State.SUSPECT:
                self._suspect(w, obs.suspicion, now)
            elif now >= w.confirm_by:
                self._confirm(w, now)
            w.next_check = max(now + 0.1, min(w.confirm_by, now + 1.0))
            return
        if w.state is State.SUSPECT and w.suspicion and w.suspicion.reason == "heartbeat":
            log.info("suspicion_dropped", pid=r.process.pid, why="a beat came")
            w.suspicion = None
        if obs.state is not w.state and not (w.state is State.SUSPECT and w.suspicion):
            self._set_state(w, obs.state)

    def _tampered(self, w: Watched, exc: untrusted.Refused) -> None:
        """A beat or status file swapped after acceptance (a directory, FIFO, link, another
        user's file): that costs this registration, nothing else."""
        reason = f"tampered_{exc.reason}"
        self.metrics.registration_errors.labels(**self.metrics.labels(reason=reason)).inc()
        log.warning("registration_refused", pid=w.process.pid, uid=w.registration.uid, reason=reason, error=str(exc))
        path = self.config.registrations / registry.file_name(w.process)
        try:
            self.refused[path.name] = path.lstat().st_mtime  # not taken back until it is written anew
        except OSError:
            pass
        self._forget(w, "tampered")

    def _suspect(self, w: Watched, suspicion: Suspicion | None, now: float) -> None:
        """One signal says stalled. Confirm before anything is done about it."""
        assert suspicion is not None
        w.suspicion = suspicion
        self._set_state(w, State.SUSPECT)
        log.info("process_suspect", pid=w.process.pid, reason=suspicion.reason, detail=suspicion.detail)
        if suspicion.reason == "heartbeat" and w.timeout_source == "learned":
            # A learned timeout may only mean a new phase: the stack must hold still too.
            w.history = type(w.history)()
            w.confirm_by = now + max(3.0, min(10.0, w.timeout / 2))
            w.next_sample = now
        else:
            w.confirm_by = now + 0.5  # a declared timeout: one more look, then act

    def _confirm(self, w: Watched, now: float) -> None:
        suspicion = w.suspicion
        assert suspicion is not None
        signals = set(suspicion.signals)
        if w.history.frozen_for() >= 2.0:
            signals.add("stack")
        why_not = None
        if suspicion.reason == "heartbeat" and w.timeout_source == "learned":
            busy = w.history.cpu_share() if w.history.samples else None
            blocked, _ = classify(w.history.samples[-1].frames if w.history.samples else (), self.blocking, self.idle)
            if "stack" not in signals:
                why_not = "the stack moved"
            elif busy is not None and busy >= 0.5 and not blocked:
                why_not = "busy on the CPU, blocked on nothing"
        if why_not:
            # The beats paused but the process works: a new phase, not a hang. Learn the longer gap.
            log.info("suspicion_dropped", pid=w.process.pid, why=why_not, paused=round(now - (w.last_progress or now), 1))
            w.intervals.append(now - (w.last_progress or now))
            w.last_progress = now
            w.suspicion = None
            w.next_sample = float("inf") if not w.watched_by_stack else now + self.config.stack_interval
            self._set_state(w, State.HEALTHY)
            return
        if w.beat is not None and w.last_progress is not None and suspicion.reason == "stack":
            if now - w.last_progress > w.timeout:
                signals.add("heartbeat")
        evidence = f"; {w.history.evidence()}" if w.history.samples and "stack" in signals else ""
        self._hung(w, Suspicion(suspicion.reason, suspicion.detail + evidence, suspicion.since, tuple(sorted(signals))))

    # -- stack sampling (on the sampler's threads) ------------------------

    def _sample(self, w: Watched, now: float) -> None:
        wait = self.limits.sample_wait(w.registration.uid, now)
        if wait:
            w.next_sample = now + wait
            if self.limits.first("pyspy_rate", w.registration.uid):
                log.warning("stack_sampling_limited", uid=w.registration.uid,
                            limit=f"pyspy_samples_per_uid = {self.config.pyspy_samples_per_uid:g}")
            return
        w.sampling = True
        pid = w.process
        native = w.state is State.SUSPECT and w.suspicion is not None and w.suspicion.reason == "stack"
        future = self.sampler.submit(take_sample, pid.pid, self.config.pyspy_timeout, native)

        def done(f: concurrent.futures.Future[Sample]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.samples.put((pid, f.result(), native))
            self._wake()

        future.add_done_callback(done)

    def _collect_samples(self, now: float) -> None:
        while True:
            try:
                pid, sample, native = self.samples.get_nowait()
            except queue.Empty:
                return
            w = self.watched.get(pid)
            if w is None:
                continue
            w.sampling = False
            if not procfs.alive(pid):
                continue
            if sample.error:
                log.warning("stack_sample_failed", pid=pid.pid, error=sample.error)
            else:
                w.history.add(sample)
            self._judge_stack(w, sample, native, now)

    def _judge_stack(self, w: Watched, sample: Sample, native: bool, now: float) -> None:
        suspect = w.state is State.SUSPECT and w.suspicion is not None
        if suspect and w.suspicion.reason == "heartbeat":  # type: ignore[union-attr]
            if len(w.history.samples) <= 1 and now < w.confirm_by:
                w.next_sample = now + 1.0  # confirming: sample fast
            elif w.history.frozen_for() >= 2.0 or now >= w.confirm_by:
                self._confirm(w, now)
            else:
                w.next_sample = now + 1.0
            return
        if suspect and native:  # the one native look at a frozen stack: does it count?
            blocked, idle = classify(sample.frames, self.blocking, self.idle)
            declared = w.stack_timeout is not None
            if declared or (blocked and not idle):
                why = "declared --stack-timeout" if declared and not blocked else f"blocked in {blocked}"
                w.suspicion = Suspicion("stack", f"the same stack for {w.history.frozen_for():.0f} s ({why})",
                                        w.suspicion.since, ("stack",))  # type: ignore[union-attr]
                self._confirm(w, now)
            else:
                if not w.idle_noted:
                    log.info("stack_frozen_idle", pid=w.process.pid, why="idle pattern" if idle else "no blocking call")
                    w.idle_noted = True
                w.suspicion = None
                self._set_state(w, State.HEALTHY)
                w.next_sample = now + self.config.stack_interval
            return
        if not w.watched_by_stack or w.state in (State.HUNG, State.CAPTURED):
            w.next_sample = float("inf") if not w.watched_by_stack else now + self.config.stack_interval
            if w.process in self.marks:
                self.marks[w.process] = rearm.with_sample(self.marks[w.process], sample)
            if w.state is State.CAPTURED:
                self._rearm_if_progressed(w)
            return
        window = w.stack_timeout or self.config.stack_window
        if len(w.history.samples) == 1:
            w.idle_noted = False
        if w.history.frozen_for() >= window and not w.idle_noted:
            w.suspicion = Suspicion("stack", f"the same stack for {w.history.frozen_for():.0f} s", time.time() - w.history.frozen_for(), ("stack",))
            self._set_state(w, State.SUSPECT)
            log.info("process_suspect", pid=w.process.pid, reason="stack", detail=w.history.evidence())
            w.confirm_by = now + self.config.pyspy_timeout + 5
            w.next_sample = now  # the native look
        else:
            w.next_sample = now + self.config.stack_interval

    def _rearm_if_progressed(self, w: Watched) -> bool:
        """A captured process is watched for a new hang only once it shows progress again."""
        m = self.marks.get(w.process)
        why = rearm.progressed(w, m) if m is not None else "no mark"
        if why is None:
            return False
        self.marks.pop(w.process, None)
        log.info("process_recovered", pid=w.process.pid, incident=w.incident, why=why)
        w.history = type(w.history)()
        self._set_state(w, State.HEALTHY)
        return True

    def _set_state(self, w: Watched, state: State) -> None:
        old = w.state
        w.state = state
        self.metrics.state_changes.labels(**self.metrics.labels(state=state.value)).inc()
        self._count_states()
        if old is not state:
            log.info("state_changed", pid=w.process.pid, job=w.registration.job, rank=w.registration.rank,
                     old=old.value, new=state.value)
        self._write_status()

    def _count_states(self) -> None:
        for s in State:
            if s is not State.EXITED:  # exited processes are forgotten, not watched
                self.metrics.watched.labels(**self.metrics.labels(state=s.value)).set(
                    sum(1 for x in self.watched.values() if x.state is s))

    def _hung(self, w: Watched, suspicion: Suspicion | None) -> None:
        assert suspicion is not None
        self._set_state(w, State.HUNG)
        self.metrics.hangs.labels(**self.metrics.labels(reason=suspicion.reason)).inc()
        log.warning("process_hung", pid=w.process.pid, job=w.registration.job, rank=w.registration.rank,
                    reason=suspicion.reason, detail=suspicion.detail, signals=list(suspicion.signals))
        w.suspicion = None
        # Every rank of the same job on this node goes into the same incident: the rank
        # that differs is the answer, and it may be one that looks healthy.
        mates = [x for x in self.watched.values() if x is not w and w.registration.job
                 and x.registration.job == w.registration.job and x.role != "launcher"
                 and x.state in (State.STARTING, State.HEALTHY, State.SUSPECT)]
        for x in mates:
            x.suspicion = None
            self._set_state(x, State.HUNG)
        job = w.registration.job
        # Every other node watching a rank of this job captures it too, under one job incident id.
        job_incident = self.fleet.declare(job, suspicion.reason, suspicion.detail) if self.fleet and job else None
        self._start_capture([w] + mates, suspicion, job_incident)

    def _start_capture(self, group: list[Watched], suspicion: Suspicion, job_incident: str | None) -> None:
        for x in group:
            self.marks[x.process] = rearm.mark(x)
        self.dumping.update(x.process.pid for x in group)
        w = group[0]
        gone = self.departures.of_job(w.registration.job, w.registration.registered_at)  # job-mates that exited: often the cause
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
                self._set_state(x, State.HUNG)
            why = Suspicion("job-request", f"node {req.node} declared job {req.job} hung ({req.reason}: {req.detail})", req.time)
            self._start_capture(group, why, req.job_incident)

    def _gate(self, outdir: Path, signals: tuple[str, ...] = ()) -> str | None:
        """May this capture take a GPU dump (which ends the process)? None means yes."""
        policy = self.config.gpu_dump
        if policy == "always":
            return None
        if policy == "never":
            return "gpu_dump = never"
        if {"heartbeat", "stack"} <= set(signals):
            log.info("gpu_dump_confirmed", dir=str(outdir), signals=list(signals))
            return None
        waiting = gpu_wait(outdir)
        if waiting:
            log.info("gpu_dump_confirmed", dir=str(outdir), frame=waiting)
            return None
        return ("not confirmed: only one signal, and no thread waits on the GPU or a collective "
                "(gpu_dump = confirmed)")

    # -- capture (on worker threads) -------------------------------------

    def _capture(self, group: list[Watched], suspicion: Suspicion, gone: list[exits.Departed],
                 job_incident: str | None = None) -> str | None:
        first = str(group[0].process.pid)

        def gate(outdir: Path) -> str | None:  # a job-mate's GPU dump needs its own evidence
            return self._gate(outdir, suspicion.signals if outdir.name == first else ())

        return capture_incident(self.store, self.steps, [w.registration for w in group], suspicion,
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
                    # No incident to show for it: watch it as before, so the hang is captured again
                    # (after a pause, so a capture that always fails does not spin).
                    self.marks.pop(w.process, None)
                    self._set_state(w, State.HEALTHY)
                    w.next_check = time.monotonic() + ERROR_BACKOFF
                else:
                    self._set_state(w, State.CAPTURED)

    def _retention(self) -> None:
        cfg = self.config
        try:
            for path in self.store.enforce_retention(cfg.max_state_bytes, cfg.dump_max_age_days * 86400,
                                                     cfg.incident_max_age_days * 86400):
                log.info("retention_removed", path=path)
        except OSError as exc:
            log.error("retention_failed", error=str(exc))
        cutoff = time.time() - 3600
        for stale in cfg.driver_logs.glob("*.log"):
            try:
                if stale.lstat().st_mtime < cutoff:
                    stale.unlink()
            except OSError:
                pass

    # -- GPU dumps nobody asked for: exceptions ---------------------------

    def _dump_appeared(self, name: str) -> None:
        if not (name.endswith(".nvcudmp") or name.endswith(gpudump.DRIVER_LOG_SUFFIX)) or name in self.ingested:
            return
        pid = gpudump.pid_of(name)
        if pid is not None and pid in self.dumping:
            return  # a capture asked for this one and takes it itself
        self.ingested.add(name)
        reg = self._registration_of(pid)  # here on the loop, which owns self.watched; the worker gets the answer
        future = self.pool.submit(self._ingest, self.config.dumps / name, pid, reg)
        future.add_done_callback(self._wake)
        fake = Watched(reg, State.CAPTURED, seen_at=time.monotonic(), timeout=0) if reg else None
        self.captures.append(_Capture([fake] if fake else [], Suspicion("gpu-exception", name, time.time()),
                                      time.monotonic(), future))

    def _registration_of(self, pid: int | None) -> Registration | None:
        if pid is None:
            return None
        for w in self.watched.values():
            if w.process.pid == pid:
                return w.registration
        return self.recent.get(pid, (None, 0.0))[0]

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
            self._guarded("dump", self._dump_appeared, name)

    def _flush_spool(self) -> None:
        """Reports kept while the state dir had no room: stored and indexed once it has."""
        pending = self.spool.pending()
        if pending:
            for incident_id in self.spool.flush(self.store):
                log.warning("incident_stored", incident=incident_id, from_spool=True)
                if self.fleet:  # the store's copy waited for the local one
                    meta = json.loads((self.store.dir / incident_id / "incident.json").read_text())
                    self.fleet.stored(incident_id, self.store.dir / incident_id, meta.get("job"), meta.get("job_incident"))
        self.metrics.incidents_pending.labels(**self.metrics.const).set(len(self.spool.pending()) if pending else 0)

    def _ingest(self, path: Path, pid: int | None, claimed: Registration | None) -> str | None:
        """One dump (or driver report without a dump), one incident; a refused file, none."""
        def count(exc_type: str) -> None:
            self.metrics.gpu_exceptions.labels(**self.metrics.labels(type=exc_type)).inc()
        try:
            return dump_ingest.ingest(self.store, path, pid, claimed, self.config.driver_logs, count,
                                      self.spool, self.metrics)
        except untrusted.Refused as exc:
            reason = f"dump_{exc.reason}"
            self.metrics.registration_errors.labels(**self.metrics.labels(reason=reason)).inc()
            log.warning("dump_refused", file=str(path), reason=reason, error=str(exc))
            return None

    # -- status ----------------------------------------------------------

    def _status(self, text: str) -> None:
        notify(f"STATUS={text}")

    def _write_status(self) -> None:
        counts: dict[str, int] = {}
        for w in self.watched.values():
            counts[w.state.value] = counts.get(w.state.value, 0) + 1
        self._write_json(Path(self.config.runtime_dir) / STATUS_FILE, {
            "pid": os.getpid(), "time": time.time(), "metrics_address": self.metrics_address,
            "processes": [w.summary() for w in self.watched.values()],
        })
        self._status(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "watching no processes")

    @staticmethod
    def _write_json(path: Path, data: dict[str, Any]) -> None:
        try:
            write_json(path, data)
        except OSError as exc:
            log.error("status_write_failed", file=str(path), error=str(exc))
