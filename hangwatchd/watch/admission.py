"""The daemon's side of registering: claims read, checked and admitted; processes watched and forgotten.

A registration file appearing (inotify, or the rescan under it) is considered:
loaded and checked (``registration_file.load``), held to its user's limit, then watched
with a pidfd so its exit is an event. Discovery adds GPU processes nobody
registered. A process leaves the watchlist when it exits, unregisters, or its
files are tampered with; an exited one is remembered a while, for late dumps
and its job-mates' incidents.

It runs on the loop, which owns the watchlist; the one thing it hands to a
worker is discovery's read of other processes' /proc files, whose answer comes
back on the loop's queue as a ``Discovered`` value (errors included). Each
process admitted waits in ``arrived`` for the loop's first look.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import selectors
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
from inotify_simple import flags as inflags

from ..config import Config
from ..host import procfs, untrusted
from ..host.user_limits import UserLimits
from ..metrics import Metrics
from ..model import ProcessId, Registration, State
from ..workload import beat_segment, exits, registration_file
from ..workload.registration_file import RegistrationError
from . import discovery, ranks
from .watched import ProgressMark, Watched, Watchlist

log = structlog.get_logger("hangwatchd.daemon")

RECENT_KEEP = 600.0  # seconds an exited process is remembered, to link a dump that comes late
MAX_LOG_DIRS = 65536  # uids whose directory of driver logs is known to stand


@dataclass(frozen=True)
class Discovered:
    """What one discovery scan found (``find_gpu_processes``), or why it found nothing."""

    registrations: tuple[Registration, ...]
    error: str | None = None


class Registrations:
    def __init__(self, config: Config, watched: Watchlist, metrics: Metrics, limits: UserLimits,
                 selector: selectors.BaseSelector, guard: Callable[..., bool],
                 post: Callable[[object], None] = lambda _m: None) -> None:
        """Each watched process's pidfd goes into the loop's ``selector`` (its exit is an event);
        ``guard`` contains a failure to one registration; ``post``: the loop's queue."""
        self.config = config
        self.watched = watched
        self.metrics = metrics
        self.limits = limits
        self.selector = selector
        self.guard = guard
        self.post = post
        self.arrived: list[Watched] = []  # admitted since the loop last took them: each gets its first look there
        # Processes a stored incident captured, still running when this daemon started (Store.captured):
        # each is admitted as captured, so that a restart never declares the same hang again.
        self.captured_before: dict[ProcessId, str] = {}
        self.refused: dict[str, float] = {}  # registration name -> mtime already refused (no log spam)
        self.over_limit: set[str] = set()  # registrations waiting for their user to drop under the limit
        self.recent: dict[int, tuple[Registration, float]] = {}  # exited processes, to link late dumps
        self.beats = registration_file.BeatsDir(config.beats)  # opened once, every beat and status file read through it
        self.departures = exits.Departures(Path(config.runtime_dir), config.exited_keep)  # for job-mates' incidents
        # Discovery reads other processes' /proc files (fd lists, environ: that read takes the target's
        # mmap lock and can block behind a process stuck in the driver): on its own thread, one scan at a time.
        self._discovery = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="discover")
        self._scanning = False  # a scan is out; its Discovered comes back on the loop's queue
        self._pids_waiting: set[int] = set()  # found by ``discovery`` while a scan ran: for the next one
        self.log_dirs: set[int] = set()  # uids whose directory of driver logs was made (or found) by this daemon

    def take_arrived(self) -> list[Watched]:
        """The processes admitted since last asked (the loop gives each its first look)."""
        out, self.arrived = self.arrived, []
        return out

    def changed(self, name: str, mask: int) -> None:
        """An inotify event on RUNTIME_DIR/registrations."""
        path = self.config.registrations / name
        if mask & (inflags.DELETE | inflags.MOVED_FROM):
            self.unregistered(name)
        elif mask & inflags.CREATE:
            # A regular file is read at CLOSE_WRITE, once complete; a symlink or
            # directory never gets one, so it is judged (and refused) now.
            if path.is_symlink() or path.is_dir():
                self.consider(path)
        else:
            self.consider(path)

    def rescan(self) -> None:
        """The safety net under inotify: pick up anything missed, drop what vanished."""
        try:
            names = {p.name for p in self.config.registrations.iterdir() if not p.name.startswith(".")}
        except OSError as exc:
            log.error("rescan_failed", dir=str(self.config.registrations), error=str(exc))
            return
        for name in names:
            self.guard("registration", self.consider, self.config.registrations / name)
        for pid_key, w in list(self.watched.items()):
            if w.registration.source != "discovered" and registration_file.file_name(pid_key) not in names:
                self.unregistered(registration_file.file_name(pid_key))
        exits.remove_stale(Path(self.config.runtime_dir), time.time() - self.config.exited_keep)
        self.refused = {k: v for k, v in self.refused.items() if k in names}
        self.over_limit &= names
        if self.config.discover:
            self.discover()

    def consider(self, path: Path) -> None:
        try:
            mtime = path.lstat().st_mtime
        except OSError:
            return
        if self.refused.get(path.name) == mtime:
            return
        try:
            reg = registration_file.load(path, self.beats)
        except RegistrationError as exc:
            self.refused[path.name] = mtime
            self.metrics.registration_errors.labels(**self.metrics.labels(reason=exc.reason)).inc()
            # Whose file: a user's flood of bad files is counted, and logged within that user's budget
            # (a file gone before it was opened is nobody's: the budget of unknown owners).
            owner = exc.uid
            if self.limits.budgets.allow("log", owner, time.monotonic()):
                log.warning("registration_refused", file=str(path)[-300:], reason=exc.reason, uid=owner, error=str(exc)[:500])
            return
        old = self.watched.get(reg.process)
        if old is not None:
            if old.registration.source != "discovered":
                return
            self.forget(old, "registered")  # a registration says more than discovery
        over = self.limits.over_registrations(reg.uid, (x.registration.uid for x in self.watched.values()
                                                          if x.registration.source != "discovered"))
        if over:
            self._refuse(path.name, "uid_limit", over, reg.uid)
            return
        self.over_limit.discard(path.name)
        self.limits.clear("uid_limit", reg.uid)
        self.watch(reg)

    def _refuse(self, name: str, reason: str, why: str, uid: int) -> None:
        """A registration over its user's limit: counted once per file, logged once per user.
        Not remembered as refused: it is admitted at a later rescan once the user is under the limit."""
        if name not in self.over_limit:
            self.over_limit.add(name)
            self.metrics.registration_errors.labels(**self.metrics.labels(reason=reason)).inc()
        if self.limits.first(reason, uid):
            log.warning("registration_refused", file=name, reason=reason, uid=uid, error=why)

    def watch(self, reg: Registration) -> None:
        try:
            pidfd = os.pidfd_open(reg.process.pid)
        except OSError:
            return  # gone already
        if not procfs.alive(reg.process):  # the pid was reused between load and pidfd_open
            os.close(pidfd)
            return
        if reg.launcher is not None and ranks.launched_above(reg) is None:
            # A registration may name any pid as its launcher: only a process of its own user that
            # it runs below is one (what the daemon writes for a launcher is written for that user).
            if self.limits.budgets.allow("log", reg.uid, time.monotonic()):
                log.warning("launcher_refused", pid=reg.process.pid, uid=reg.uid, launcher=reg.launcher,
                            why="not a process of this user that it runs below")
            reg = dataclasses.replace(reg, launcher=None)
        now = time.monotonic()
        timeout = reg.heartbeat_timeout or self.config.heartbeat_timeout
        source = "registration" if reg.heartbeat_timeout else "config"
        state = State.STARTING if reg.beat_file else State.HEALTHY
        stack_timeout = reg.stack_timeout or self._stack_timeout_for(reg)
        role = reg.role
        probe = Watched(reg, state, seen_at=now, timeout=timeout, role=role)
        launcher = ranks.launcher_of(probe, self.watched.values())
        if launcher is not None and launcher.role != "launcher":
            self.watched.change(launcher, role="launcher")
            log.info("launcher_found", pid=launcher.process.pid, rank_pid=reg.process.pid, job=reg.job)
        if ranks.ranks_below(probe, self.watched.values()):
            role = "launcher"
        by_stack = role != "launcher" and (reg.beat_file is None or stack_timeout is not None)
        incident = self.captured_before.pop(reg.process, None)
        mark = None
        if incident is not None:  # captured before this daemon started: watched for progress, like any captured hang
            state, mark = State.CAPTURED, ProgressMark(self._beats(reg), None)
            log.info("process_adopted_as_captured", pid=reg.process.pid, incident=incident)
        w = Watched(reg, state, seen_at=now, timeout=timeout, next_check=now, timeout_source=source,
                    stack_timeout=stack_timeout, role=role, pidfd=pidfd,
                    stack_timeout_source="registration" if reg.stack_timeout else "config",
                    stack_window=self.config.stack_window, next_sample=now if by_stack else float("inf"),
                    incident=incident, mark=mark)
        if not self.watched.admit(w):
            os.close(pidfd)
            self._refuse(registration_file.file_name(reg.process), "watch_limit",
                         f"{len(self.watched)} processes watched already (max_watched)", reg.uid)
            return
        self.selector.register(pidfd, selectors.EVENT_READ, reg.process)
        if reg.source == "run" and reg.uid not in self.log_dirs:
            self._log_dir(reg.uid, now)
        log.info("process_registered", pid=reg.process.pid, job=reg.job, rank=reg.rank, timeout=timeout,
                 stack_timeout=w.stack_timeout, source=reg.source, cmdline=" ".join(reg.cmdline)[:200])
        self.arrived.append(w)

    def _log_dir(self, uid: int, now: float) -> None:
        """The user's directory of driver logs, made once per uid (its launchers keep the driver's
        lines there); where it cannot be, its driver's lines are not kept and nothing else is lost."""
        why = registration_file.user_dir(self.config.driver_logs, uid)
        if why is None:
            if len(self.log_dirs) >= MAX_LOG_DIRS:
                self.log_dirs.clear()  # bounded: past it, a user's directory is only checked again
            self.log_dirs.add(uid)
        elif self.limits.budgets.allow("log", uid, now):
            log.warning("driver_log_dir_failed", uid=uid, why=why)

    @staticmethod
    def _beats(reg: Registration) -> int | None:
        """Its beat count now (None: it never beat, or it has no segment): the mark a new beat passes."""
        if reg.beat_at is None:
            return None
        try:
            return beat_segment.read(reg.beat_at).count or None
        except beat_segment.SegmentError:
            return None

    def _stack_timeout_for(self, reg: Registration) -> float | None:
        command = " ".join(reg.cmdline)
        for pattern, seconds in self.config.stack_timeouts.items():
            if re.search(pattern, command):
                return float(seconds)
        return None

    def discover(self, pids: list[int] | None = None) -> None:
        """Every process holding /dev/nvidia* open (or ``pids``, found so by ``discovery``), watched by
        its stack (a sidecar's view of the pod). The reads of their /proc files run on a thread of
        their own, one scan at a time (pids that come meanwhile wait for the next); ``discovered``
        admits what a scan found."""
        if pids is not None:
            self._pids_waiting.update(pids)
        if self._scanning:
            return
        if pids is not None or self._pids_waiting:
            pids, self._pids_waiting = sorted(self._pids_waiting), set()
        known = frozenset({p.pid for p in self.watched} | {os.getpid()})
        workers_of = frozenset(k.pid for k, w in self.watched.items() if w.role != "launcher")
        self._scanning = True
        self._discovery.submit(self._scan, known, workers_of, self.config.discover_devices, pids)

    def _scan(self, known: frozenset[int], workers_of: frozenset[int], prefix: str, pids: list[int] | None) -> None:
        """On the discovery worker: the scan's finds, or its exception, as a value on the loop's queue."""
        found: Discovered = Discovered((), "the scan stopped before it finished")
        try:
            found = Discovered(tuple(find_gpu_processes(known, workers_of, prefix, pids)))
        except Exception as exc:  # whatever it was, the loop hears of it as this scan's error
            log.exception("discovery_failed", error=f"{type(exc).__name__}: {exc}")
            found = Discovered((), f"{type(exc).__name__}: {exc}")
        finally:
            self.post(found)

    def discovered(self, found: Discovered) -> None:
        """Watch what a discovery scan found (on the loop, once the scan is done); pids that came
        meanwhile get their scan now."""
        self._scanning = False
        for reg in found.registrations:
            if reg.process not in self.watched and procfs.alive(reg.process):
                self.watch(reg)
        if self._pids_waiting:
            self.discover([])

    def stop(self) -> None:
        self._discovery.shutdown(wait=False, cancel_futures=True)

    def unregistered(self, name: str) -> None:
        for key, w in list(self.watched.items()):
            if registration_file.file_name(key) == name:
                gone = not procfs.alive(key) or exits.read(Path(self.config.runtime_dir), key, w.registration.uid)
                if gone:  # removed at (or by its launcher after) its exit, before the pidfd was read
                    self.exited(key)
                else:
                    self.forget(w, "unregistered")

    def exited(self, process: ProcessId) -> None:
        w = self.watched.get(process)
        if w is not None:
            now = time.monotonic()
            self.recent = {pid: v for pid, v in self.recent.items() if now - v[1] < RECENT_KEEP}
            self.recent[process.pid] = (w.registration, now)
            if w.role != "launcher":
                self.departures.add(w.departed(time.time()))
            self.forget(w, "exited")
            registration_file.remove(self.config.registrations, process)
            if w.registration.beat_at:
                # Only the very file accepted, through the beats dir's descriptor: never a path
                # the user named, never a file put under its name since (that is left to its owner).
                w.registration.beat_at.unlink()

    def forget(self, w: Watched, why: str) -> None:
        log.info("process_forgotten", pid=w.process.pid, why=why, job=w.registration.job, rank=w.registration.rank)
        pidfd = w.pidfd
        if pidfd is not None:
            self.selector.unregister(pidfd)
            os.close(pidfd)
        self.watched.forget(w)  # its life (state, marks, timers, suspicion) goes with the record
        r = w.registration
        try:
            self.metrics.last_beat.remove(*self.metrics.const.values(), r.job or "", str(r.rank if r.rank is not None else ""), str(r.process.pid))
            self.metrics.timeout.remove(*self.metrics.const.values(), r.job or "", str(r.rank if r.rank is not None else ""), str(r.process.pid))
        except KeyError:
            pass

    def tampered(self, w: Watched, exc: untrusted.Refused) -> None:
        """A beat or status file swapped after acceptance (a directory, FIFO, link, another
        user's file): that costs this registration, nothing else."""
        reason = f"tampered_{exc.reason}"
        self.metrics.registration_errors.labels(**self.metrics.labels(reason=reason)).inc()
        log.warning("registration_refused", pid=w.process.pid, uid=w.registration.uid, reason=reason, error=str(exc))
        path = self.config.registrations / registration_file.file_name(w.process)
        try:
            self.refused[path.name] = path.lstat().st_mtime  # not taken back until it is written anew
        except OSError:
            pass
        self.forget(w, "tampered")

    def registration_of(self, pid: int | None) -> Registration | None:
        """Whose a dump naming ``pid`` is: a watched process, or one that exited lately."""
        if pid is None:
            return None
        for w in self.watched.values():
            if w.process.pid == pid:
                return w.registration
        return self.recent.get(pid, (None, 0.0))[0]


def find_gpu_processes(known: frozenset[int], workers_of: frozenset[int], prefix: str,
                       pids: list[int] | None = None) -> list[Registration]:
    """Every process holding /dev/nvidia* open (or ``pids``) and not yet ``known``, as a discovered
    registration (a sidecar's view of the pod). Reads other processes' /proc files (their fd
    lists, their environ: that read takes the target's mmap lock and can block behind a process
    stuck in the driver): never on the loop thread. ``workers_of``: the pids watched as workloads."""
    found_list = discovery.holders(prefix) if pids is None else pids
    found = set(found_list)
    out = []
    for pid in found_list:
        if pid in known:
            continue
        # A DataLoader or multiprocessing worker inherits its parent's /dev/nvidia* files: it is
        # captured with its parent (capture/children), never watched as a process of its own.
        if set(procfs.ancestors(pid)) & (workers_of | found):
            continue
        reg = registration_file.from_proc(pid, source="discovered")
        if reg is not None:
            out.append(reg)
    return out
