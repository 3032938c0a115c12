"""What the daemon does once a hang's incident is stored: report it (the default), or end the job here.

``on_hang = "abort"`` (the config, root's choice for every process) or
``hangwatchd run --on-hang abort`` (the job owner's, in their own
registration, which wins) ends the job's ranks on this node: SIGABRT first, so
a framework's own handlers can dump, then SIGKILL after ``abort_grace``. Never
before the incident is stored (the evidence would die with the process), never
a process that is not the job's (each is signalled through a pidfd opened and
checked against its start time, so a reused pid is never hit), and never one
whose policy is not abort.

Before signalling, it leaves its word for ``hangwatchd run`` (``workload.ended``):
the launcher puts the incident in its exit record and exits non-zero.
"""

from __future__ import annotations

import heapq
import json
import os
import select
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import structlog

from ..host import procfs
from ..host.atomic import write_atomic
from ..metrics import Metrics
from ..model import ProcessId, Registration, is_job_mate
from ..watch.ranks import launched_above
from ..workload import ended

log = structlog.get_logger("hangwatchd.act")

ENDED_KEEP = 86400.0  # seconds an ended record is kept for its launcher
MAX_PENDING = 4096  # processes waiting for their SIGKILL: a bound, like every table of the daemon's


def policy(reg: Registration, default: str) -> str:
    """The job owner's choice from their own registration, else root's config."""
    return reg.on_hang or default


def prepare(runtime_dir: Path) -> None:
    """The daemon's own dir for ended records: nobody else writes there, so a launcher can believe it."""
    d = runtime_dir / ended.DIR
    d.mkdir(mode=0o755, exist_ok=True)
    st = os.lstat(d)
    if st.st_uid == os.geteuid():
        os.chmod(d, 0o755)


class Acting:
    """Ends a stored hang's job on this node when its policy says abort; SIGKILLs after the grace on its own thread."""

    def __init__(self, runtime_dir: Path, default: str, grace: float, metrics: Metrics, on_request: bool = False) -> None:
        self.runtime_dir = runtime_dir
        self.default = default
        self.grace = grace
        self.on_request = on_request  # abort_on_request: root lets another node's request end ranks here
        self.metrics = metrics
        self._due: list[tuple[float, int, int]] = []  # (monotonic deadline, pidfd, pid): SIGKILL then
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._reap, name="abort-grace", daemon=True)
        self._thread.start()

    def action(self, regs: Iterable[Registration], requested: str | None = None) -> str:
        """abort when every one of these processes' policy says abort (and the request, where one asked)."""
        regs = list(regs)
        if not regs or requested == "report":
            return "report"
        return "abort" if all(policy(r, self.default) == "abort" for r in regs) else "report"

    def after_store(self, regs: Sequence[Registration], incident: str, requested: str | None = None) -> list[int]:
        """The incident is stored: end these processes (the job's ranks here) if their policy says abort.

        ``requested``: the action another node's capture request carried, when the capture came
        from the store rather than from this node's own judgement. Such a capture ends nothing
        unless root allowed it (``abort_on_request``), and then only ranks whose own policy says
        abort, and only when the request said abort: the store is written by anyone who holds its
        keys, and the owner's ``--on-hang abort`` means "when hung", not "when someone says so".
        Returns the pids signalled."""
        # The job is (owner uid, name): only the hung process and its job-mates are its ranks.
        owner = regs[0].uid if regs else None
        targets = [r for i, r in enumerate(regs) if (i == 0 and r.role != "launcher" or is_job_mate(regs[0], r))
                   and policy(r, self.default) == "abort"]
        if requested is not None and not (requested == "abort" and self.on_request):
            if requested == "abort" and targets:
                log.info("abort_not_taken", incident=incident, pids=[r.process.pid for r in targets], uid=owner,
                         why="another node's request asked for it, this node did not see these processes hung, "
                             "and abort_on_request is off")
            log.info("hang_acted", incident=incident, action="report", requested=requested)
            return []
        if not targets:
            log.info("hang_acted", incident=incident, action="report")
            return []
        now = time.time()
        self._prune(now)
        signalled = []
        for r in targets:
            pidfd = self._open(r.process)
            if pidfd is None:
                continue  # gone already (or another process now): nothing of the job's to end
            self._record(r.process, incident, now)
            above = launched_above(r)
            if above is not None:  # a rank below hangwatchd run: its launched process learns it too
                self._record(above, incident, now)
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGABRT)
            except ProcessLookupError:
                os.close(pidfd)
                continue
            signalled.append(r.process.pid)
            self._kill_later(pidfd, r.process.pid)
        log.info("hang_acted", incident=incident, action="abort", pids=signalled)
        if signalled:
            self.metrics.jobs_aborted.labels(**self.metrics.const).inc()
            log.warning("job_aborted", incident=incident, job=targets[0].job, pids=signalled, grace=self.grace,
                        signal="SIGABRT", then="SIGKILL")
        return signalled

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=5)  # pidfd sends do not block: this is the pending SIGKILLs' time, no more

    # -- the pieces ----------------------------------------------------------

    @staticmethod
    def _open(process: ProcessId) -> int | None:
        """A pidfd for exactly this process: opened first, then its start time checked, so a pid
        reused between the check and the signal cannot be hit."""
        try:
            pidfd = os.pidfd_open(process.pid)
        except OSError:
            return None
        if procfs.start_time(process.pid) != process.start_time:
            os.close(pidfd)
            return None
        return pidfd

    def _record(self, process: ProcessId, incident: str, now: float) -> None:
        try:
            write_atomic(ended.path_of(self.runtime_dir, process),
                                      json.dumps({"incident": incident, "action": "abort", "time": now}).encode())
        except OSError as exc:
            log.error("ended_record_failed", pid=process.pid, error=str(exc))

    def _prune(self, now: float) -> None:
        """Records whose launchers have long read them (or never will): the dir stays small."""
        try:
            with os.scandir(self.runtime_dir / ended.DIR) as entries:
                for e in entries:
                    if e.is_file(follow_symlinks=False) and now - e.stat(follow_symlinks=False).st_mtime > ENDED_KEEP:
                        os.unlink(e.path)
        except OSError:
            pass

    def _kill_later(self, pidfd: int, pid: int) -> None:
        with self._cond:
            if len(self._due) >= MAX_PENDING:
                _kill(pidfd, pid)  # no room to wait: the grace is lost, the bound is kept
                return
            heapq.heappush(self._due, (time.monotonic() + self.grace, pidfd, pid))
            self._cond.notify()

    def _reap(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cond.wait(timeout=self._due[0][0] - time.monotonic() if self._due else None)
                if self._stopping:
                    # The daemon stops during a grace: the owner asked for the job to end, so it ends now,
                    # rather than never (nobody would be left to send the SIGKILL).
                    for _, fd, pid in self._due:
                        _kill(fd, pid)
                    self._due.clear()
                    return
                _, pidfd, pid = heapq.heappop(self._due)
            _kill(pidfd, pid)


def _kill(pidfd: int, pid: int) -> None:
    """SIGKILL unless it has exited (a pidfd turns readable at exit)."""
    try:
        poller = select.poll()  # not select(): a descriptor past 1023 is refused there
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(0):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            log.warning("abort_grace_over", pid=pid, signal="SIGKILL")
    except OSError:
        pass
    finally:
        os.close(pidfd)
