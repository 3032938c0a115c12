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
from prometheus_client import start_http_server

from . import __version__, gpudump, procfs, registry
from .analyze.stacks import gpu_wait
from .cudacore import driverlog
from .runtime import DAEMON_FILE, STATUS_FILE, write_json
from .capture import capture_incident, make_steps
from .config import Config
from .detect import HeartbeatDetector
from .metrics import Metrics, create
from .model import Incident, ProcessCapture, ProcessId, Registration, State, StepResult, Suspicion
from .notify import notify, watchdog_interval
from .registry import RegistrationError, Watched
from .store import Store

log = structlog.get_logger("hangwatchd.daemon")

STATUS_EVERY = 2.0
RETENTION_EVERY = 600.0


class SetupError(Exception):
    """The daemon cannot start here: one line saying what and where."""


@dataclass
class _Capture:
    watched: list[Watched]
    suspicion: Suspicion
    started: float
    future: concurrent.futures.Future[str | None]


@dataclass
class Daemon:
    config: Config
    metrics: Metrics = field(default_factory=create)
    watched: dict[registry.ProcessId, Watched] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.store = Store(self.config.state_dir)
        self.detector = HeartbeatDetector(self.config.startup_grace)
        self.steps = make_steps(self.config)
        self.selector = selectors.DefaultSelector()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="capture")
        self.captures: list[_Capture] = []
        self.refused: dict[str, float] = {}  # registration name -> mtime already refused (no log spam)
        self.pidfds: dict[int, registry.ProcessId] = {}
        self.dumping: set[int] = set()  # pids whose GPU dump a capture is taking: not exception dumps
        self.ingested: set[str] = set()  # dump files already made into incidents
        self.recent: dict[int, tuple[Registration, float]] = {}  # exited processes, to link late dumps
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
        except OSError as exc:
            where = exc.filename or self.config.runtime_dir
            if exc.errno == 98:
                raise SetupError(f"metrics address {self.config.metrics_address} is in use; "
                                 "pass --metrics-address HOST:PORT") from None
            raise SetupError(f"{where}: {exc.strerror}; pass --state-dir/--runtime-dir/--dump-dir "
                             "that this user can create and write") from None

    def _prepare(self) -> None:
        cfg = self.config
        self.store.open()
        for incident_id in self.store.recover():
            log.warning("incident_recovered", incident=incident_id)
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
            host, _, port = cfg.metrics_address.rpartition(":")
            server, _thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=self.metrics.registry)
            self.metrics_address = f"{host or '0.0.0.0'}:{server.server_port}"
        self.metrics.info.info({"version": __version__})
        me = procfs.identify(os.getpid())
        self._write_json(Path(cfg.runtime_dir) / DAEMON_FILE, {
            "pid": os.getpid(), "start_time": me.start_time if me else None, "version": __version__,
            "state_dir": cfg.state_dir, "dump_dir": str(cfg.dumps), "metrics_address": self.metrics_address,
        })

    def stop(self, *_: object) -> None:
        self.stopping = True
        try:
            self._wake_w.send(b"s")
        except OSError:
            pass

    def run(self) -> int:
        self.prepare()
        old = {s: signal.signal(s, self.stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.rescan()
            notify("READY=1")
            self._status(f"watching {len(self.watched)} processes")
            log.info("daemon_ready", state_dir=self.config.state_dir, runtime_dir=self.config.runtime_dir,
                     metrics=self.metrics_address, pid=os.getpid())
            self.loop()
        finally:
            notify("STOPPING=1")
            log.info("daemon_stopping", captures_in_flight=len(self.captures))
            self.pool.shutdown(wait=True, cancel_futures=True)
            for s, h in old.items():
                signal.signal(s, h)
            for name in (DAEMON_FILE, STATUS_FILE):
                (Path(self.config.runtime_dir) / name).unlink(missing_ok=True)
        return 0

    # -- the loop --------------------------------------------------------

    def loop(self) -> None:
        now = time.monotonic()
        next_rescan = now + self.config.rescan_interval
        ping_every = watchdog_interval()
        next_ping = now
        next_status = now
        next_retention = now
        while not self.stopping:
            now = time.monotonic()
            timers = [next_rescan, next_status, next_retention] + [w.next_check for w in self.watched.values()]
            if ping_every:
                timers.append(next_ping)
            timeout = max(0.0, min(timers) - now)
            events = self.selector.select(timeout)
            started = time.monotonic()
            for key, _mask in events:
                if key.data == "inotify":
                    self._on_inotify()
                elif key.data == "wake":
                    self._drain_wake()
                elif isinstance(key.data, registry.ProcessId):
                    self._on_exit(key.data)
            now = time.monotonic()
            self._collect_captures()
            for w in list(self.watched.values()):
                if w.next_check <= now:
                    self._observe(w, now)
            if now >= next_rescan:
                self.rescan()
                next_rescan = now + self.config.rescan_interval
            if now >= next_status:
                self._write_status()
                next_status = now + STATUS_EVERY
            if now >= next_retention and not self.captures:
                self.pool.submit(self._retention)
                next_retention = now + RETENTION_EVERY
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

    # -- registrations ---------------------------------------------------

    def _on_inotify(self) -> None:
        for event in self.inotify.read(timeout=0):
            name = event.name
            if not name or name.startswith("."):
                continue
            if event.wd == self.dump_wd:
                self._dump_appeared(name)
                continue
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
            self._consider(self.config.registrations / name)
        for pid_key in list(self.watched):
            if registry.file_name(pid_key) not in names:
                self._unregistered(registry.file_name(pid_key))
        self.refused = {k: v for k, v in self.refused.items() if k in names}

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
        if reg.process in self.watched:
            return
        try:
            pidfd = os.pidfd_open(reg.process.pid)
        except OSError:
            return  # gone already
        if not procfs.alive(reg.process):  # the pid was reused between load and pidfd_open
            os.close(pidfd)
            return
        now = time.monotonic()
        timeout = reg.heartbeat_timeout or self.config.heartbeat_timeout
        w = Watched(reg, State.STARTING, seen_at=now, timeout=timeout, next_check=now)
        self.watched[reg.process] = w
        self.pidfds[pidfd] = reg.process
        self.selector.register(pidfd, selectors.EVENT_READ, reg.process)
        w.pidfd = pidfd
        log.info("process_registered", pid=reg.process.pid, job=reg.job, rank=reg.rank, timeout=timeout,
                 source=reg.source, cmdline=" ".join(reg.cmdline)[:200])
        self._set_state(w, State.STARTING)
        self._observe(w, now)

    def _unregistered(self, name: str) -> None:
        for key, w in list(self.watched.items()):
            if registry.file_name(key) == name:
                self._forget(w, "unregistered")

    def _on_exit(self, process: registry.ProcessId) -> None:
        w = self.watched.get(process)
        if w is not None:
            now = time.monotonic()
            self.recent = {pid: v for pid, v in self.recent.items() if now - v[1] < 600}
            self.recent[process.pid] = (w.registration, now)
            self._forget(w, "exited")
            registry.remove(self.config.registrations, process)
            if w.registration.beat_file:
                Path(w.registration.beat_file).unlink(missing_ok=True)

    def _forget(self, w: Watched, why: str) -> None:
        self._set_state(w, State.EXITED)
        log.info("process_forgotten", pid=w.process.pid, why=why, job=w.registration.job, rank=w.registration.rank)
        pidfd = w.pidfd
        if pidfd is not None:
            self.selector.unregister(pidfd)
            os.close(pidfd)
            self.pidfds.pop(pidfd, None)
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
        obs = self.detector.observe(w, now)
        w.next_check = obs.next_check
        r = w.registration
        labels = self.metrics.labels(job=r.job or "", rank=str(r.rank if r.rank is not None else ""), pid=str(r.process.pid))
        self.metrics.timeout.labels(**labels).set(w.timeout)
        if w.beat is not None and w.beat.count:
            self.metrics.last_beat.labels(**labels).set(w.beat.wall_time() or 0)
        if obs.state is State.HUNG:
            if w.state in (State.STARTING, State.HEALTHY):
                self._hung(w, obs.suspicion)
            # Hung or captured: look again later in case it recovers, without spinning.
            w.next_check = now + min(w.timeout, 5.0)
        elif obs.state is not w.state and not (w.state is State.HUNG and obs.state is State.HEALTHY):
            if w.state is State.CAPTURED and obs.state is State.HEALTHY:
                log.info("process_recovered", pid=r.process.pid, incident=w.incident)
            self._set_state(w, obs.state)

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
                    reason=suspicion.reason, detail=suspicion.detail)
        group = [w]
        self.dumping.update(x.process.pid for x in group)
        future = self.pool.submit(self._capture, group, suspicion)
        future.add_done_callback(lambda _f: self._wake_w.send(b"c"))
        self.captures.append(_Capture(group, suspicion, time.monotonic(), future))

    def _gate(self, outdir: Path) -> str | None:
        """May this capture take a GPU dump (which ends the process)? None means yes."""
        policy = self.config.gpu_dump
        if policy == "always":
            return None
        if policy == "never":
            return "gpu_dump = never"
        waiting = gpu_wait(outdir)
        if waiting:
            log.info("gpu_dump_confirmed", dir=str(outdir), frame=waiting)
            return None
        return "not confirmed: no thread waits on the GPU or a collective (gpu_dump = confirmed)"

    # -- capture (on worker threads) -------------------------------------

    def _capture(self, group: list[Watched], suspicion: Suspicion) -> str | None:
        return capture_incident(self.store, self.steps, [w.registration for w in group], suspicion,
                                self.config.capture_timeout, self.metrics, self._gate)

    def _collect_captures(self) -> None:
        for c in [c for c in self.captures if c.future.done()]:
            self.captures.remove(c)
            try:
                incident_id = c.future.result()
            except Exception as exc:  # noqa: BLE001 - a failed capture must never stop the loop
                log.error("capture_failed", pids=[w.process.pid for w in c.watched], error=f"{type(exc).__name__}: {exc}")
                incident_id = None
            else:
                self.metrics.incidents.labels(**self.metrics.labels(reason=c.suspicion.reason)).inc()
                log.warning("incident_stored", incident=incident_id, reason=c.suspicion.reason,
                            pids=[w.process.pid for w in c.watched], seconds=round(time.monotonic() - c.started, 3))
            for w in c.watched:
                self.dumping.discard(w.process.pid)
                w.incident = incident_id
                if w.process in self.watched and w.state is State.HUNG:
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
                if stale.stat().st_mtime < cutoff:
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
        future = self.pool.submit(self._ingest, self.config.dumps / name, pid)
        future.add_done_callback(lambda _f: self._wake_w.send(b"c"))
        reg = self._registration_of(pid)
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

    def _ingest(self, path: Path, pid: int | None) -> str:
        """One dump (or driver report without a dump), one incident."""
        reg = self._registration_of(pid) or Registration(ProcessId(pid or 0, 0), uid=-1)
        start = time.monotonic()
        draft = self.store.begin("gpu-exception", reg.job, [pid] if pid else [])
        outdir = draft.path / str(pid or "unknown")
        outdir.mkdir(parents=True)
        if path.name.endswith(gpudump.DRIVER_LOG_SUFFIX):
            lines = path.read_text(errors="replace").splitlines()
            report = driverlog.parse(lines)
            gpudump.copy_text(path, outdir / "driver.log")
            path.unlink(missing_ok=True)
            step = StepResult("driver_log", True, time.monotonic() - start, files=("driver.log",))
            detail = f"the driver reported {report.summary()} but wrote no dump"
            exc_type = report.exception or "UNKNOWN"
        else:
            stored = gpudump.store(path, outdir)
            files = list(stored.files)
            if pid and gpudump.copy_text(self.config.driver_logs / f"{pid}.log", outdir / "driver.log"):
                files.append("driver.log")
            step = StepResult("cuda_dump", bool(stored.files), time.monotonic() - start, stored.note, tuple(files))
            detail, exc_type = _describe(stored.symbolized, path.name, stored.note)
        self.metrics.gpu_exceptions.labels(**self.metrics.labels(type=exc_type)).inc()
        incident = Incident(id=draft.id, time=draft.time, host=socket.gethostname(), reason="gpu-exception",
                            detail=detail, job=reg.job, processes=(ProcessCapture(reg, (step,)),))
        self.store.commit(draft, incident, f"gpu-exception: {detail}")
        return draft.id

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


def _describe(sym: object, name: str, note: str | None) -> tuple[str, str]:
    """One line for an exception dump: what, in which kernel, where; and the exception type."""
    from .cudacore.symbolize import Symbolized

    if not isinstance(sym, Symbolized):
        return f"{name}: {note or 'unreadable dump'}", "UNREADABLE"
    for e in sym.exceptions:
        where = next((f" at {f.file}:{f.line}" for f in e.frames if f.file), "")
        return f"{e.type} in {e.kernel or 'an unknown kernel'}{where}", e.type
    kernels = ", ".join(k.name for k in sym.kernels) or "no running kernel"
    return f"GPU coredump with no exception ({kernels})", "NONE"
