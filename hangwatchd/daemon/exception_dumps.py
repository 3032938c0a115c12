"""An exception dump (or a driver's report without one) found in the dump dir, made into one incident.

The dump dir is world-writable: a file there says whose it is only by its
owner, never by its name. It is opened once through ``untrusted`` (a link, a
FIFO or a directory is refused before anything is read) and linked to the pid
its name carries only when that process runs as the file's owner. A file naming
another user's process is filed as its owner's, against no process, and does
not count as that process's GPU exception.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path

import structlog

from ..analyze import surfaced
from ..analyze.verdict import analyze
from ..capture import dump_artifacts
from ..cudacore import driverlog
from ..host import procfs, untrusted
from ..incidents.spool import Spool, begin_draft, finish_draft
from ..incidents.store import Store
from ..metrics import Metrics, exception_type
from ..model import Incident, ProcessCapture, ProcessId, Registration, StepResult
from ..workload import dump_names
from ..workload.runtime_files import driver_log
from .make_incident import write_pages

log = structlog.get_logger("hangwatchd.daemon")


@dataclass(frozen=True)
class Filed:
    """A dump made into an incident: its id, and whether it is linked to the process its name gives."""

    incident: str
    linked: bool


@dataclass(frozen=True)
class Attribution:
    registration: Registration
    linked: bool  # the pid of the name is a process of the file's owner (or names none)
    note: str | None  # why it is not linked


def attribute(owner: int, pid: int | None, claimed: Registration | None) -> Attribution:
    """Whose the file is: the claimed process's only when it runs as ``owner``."""
    if pid is None:
        return Attribution(Registration(ProcessId(0, 0), uid=owner), False, None)
    if claimed is not None:
        if claimed.uid == owner:
            return Attribution(claimed, True, None)
        runs_as: int | None = claimed.uid
    else:
        runs_as = procfs.uid(pid) if procfs.start_time(pid) is not None else None
        if runs_as is None and procfs.start_time(pid) is None:
            # No such process: nobody else's to file it against; it is the owner's claim.
            return Attribution(Registration(ProcessId(pid, 0), uid=owner), True, None)
        if runs_as == owner:
            return Attribution(Registration(ProcessId(pid, 0), uid=owner), True, None)
    # Whose process it names is not said: a file a user planted never puts another user's pid
    # (or uid) into the planter's own incident, log line or counters.
    note = f"written by uid {owner} but names a process that does not run as uid {owner}: not linked to it"
    return Attribution(Registration(ProcessId(0, 0), uid=owner), False, note)


def ingest(store: Store, path: Path, pid: int | None, claimed: Registration | None, driver_logs: Path,
           count: Callable[[str], None], spool: Spool | None = None, metrics: Metrics | None = None) -> Filed:
    """Make ``path`` into an incident and say which; ``count(type)`` is called for a linked
    exception. Raises untrusted.Refused (nothing is filed) when the file is not a regular file.

    With a ``spool``, a state dir without room keeps the report there (and the raw dump
    where it lies) until it has room."""
    start = time.monotonic()
    is_log = path.name.endswith(dump_names.DRIVER_LOG_SUFFIX)
    fd = untrusted.open_fd(path, None, max_size=dump_artifacts.MAX_TEXT if is_log else dump_artifacts.MAX_DUMP)
    try:
        st = os.fstat(fd)
        who = attribute(st.st_uid, pid, claimed)
        reg = who.registration
        linked_pid = reg.process.pid if who.linked and reg.process.pid else None
        draft = begin_draft(store, spool, "gpu-exception", reg.job, [linked_pid] if linked_pid else [], metrics)
        outdir = draft.path / str(linked_pid or "unknown")
        outdir.mkdir(parents=True)
        if is_log:
            lines = untrusted.read_fd(fd, path, dump_artifacts.MAX_TEXT, 10.0).decode("utf-8", "replace").splitlines()
            report = driverlog.parse(lines)
            (outdir / "driver.log").write_text("\n".join(lines) + "\n")
            dump_artifacts.unlink_same(path, st)
            step = StepResult("driver_log", True, time.monotonic() - start, who.note, files=("driver.log",))
            detail = f"the driver reported {report.summary()} but wrote no dump{surfaced.in_traceback(report.frames, report.replay)}"
            exc_type = report.exception or "UNKNOWN"
        else:
            stored = dump_artifacts.store_fd(fd, path, outdir, remove_source=True, keep_dump=not draft.spooled)
            files = list(stored.files)
            # The launcher's record of this pid's driver lines, only when it is the same user's.
            if linked_pid and dump_artifacts.copy_text(driver_log(driver_logs, reg.uid, linked_pid), outdir / "driver.log", reg.uid):
                files.append("driver.log")
            note = "; ".join(n for n in (stored.note, who.note) if n) or None
            step = StepResult("cuda_dump", bool(stored.files), time.monotonic() - start, note, tuple(files))
            detail, exc_type = describe(stored.symbolized, path.name, stored.note)
    finally:
        os.close(fd)
    if who.linked:
        count(exc_type)
    else:
        detail = f"{detail} ({who.note})" if who.note else detail
    incident = Incident(id=draft.id, time=draft.time, host=socket.gethostname(), reason="gpu-exception",
                        detail=detail, job=reg.job, processes=(ProcessCapture(reg, (step,)),))
    analysis = None
    try:
        result = analyze(draft.path)
        analysis = result.to_dict()
        # The dump's verdict where it was read; else the driver's own report says more than "nothing was captured".
        told = any(r.verdict == "gpu-exception" for r in result.ranks)
        incident = dataclasses.replace(incident, verdict=result.summary if told else detail)
        write_pages(draft.path, incident, analysis)
    except Exception as exc:  # the page is a convenience; the dump's report is stored all the same
        log.error("analysis_failed", incident=draft.id, error=f"{type(exc).__name__}: {exc}", exc_info=True)
    finish_draft(store, spool, draft, incident, f"gpu-exception: {detail}", analysis, metrics=metrics)
    try:
        store.mark_ingested(path.name)
    except Exception:  # noqa: BLE001 - remembered in the daemon's memory for this run; a full index forgets it
        pass
    return Filed(draft.id, who.linked)


def ingest_counted(store: Store, path: Path, pid: int | None, claimed: Registration | None, driver_logs: Path,
                   metrics: Metrics, spool: Spool | None = None,
                   may_log: Callable[[int | None], bool] = lambda uid: True) -> Filed | None:
    """``ingest`` as the daemon runs it: a linked exception counted in
    ``hangwatchd_gpu_exceptions_total`` (type from a closed set); a refused file counted, logged
    while its owner's log budget (``may_log``) lasts, and no incident."""
    def count(exc_type: str) -> None:
        metrics.gpu_exceptions.labels(**metrics.labels(type=exception_type(exc_type))).inc()
    try:
        return ingest(store, path, pid, claimed, driver_logs, count, spool, metrics)
    except untrusted.Refused as exc:
        reason = f"dump_{exc.reason}"
        metrics.registration_errors.labels(**metrics.labels(reason=reason)).inc()
        try:
            owner: int | None = os.lstat(path).st_uid
        except OSError:
            owner = None
        if may_log(owner):
            log.warning("dump_refused", file=str(path), reason=reason, error=str(exc))
        return None


def describe(sym: object, name: str, note: str | None) -> tuple[str, str]:
    """One line for an exception dump: what, in which kernel, where; and the exception type."""
    from ..cudacore.symbolize import Symbolized

    if not isinstance(sym, Symbolized):
        return f"{name}: {note or 'unreadable dump'}", "UNREADABLE"
    for e in sym.exceptions:
        where = next((f" at {f.file}:{f.line}" for f in e.frames if f.file), "")
        return f"{e.type} in {e.kernel or 'an unknown kernel'}{where}", e.type
    kernels = ", ".join(k.name for k in sym.kernels) or "no running kernel"
    return f"GPU coredump with no exception ({kernels})", "NONE"


# Dumps nobody saw arrive: a look at the dump dir at start and after an inotify overflow.
#
# inotify only reports what happens while the daemon watches. A dump written
# while the daemon was down, or whose event was lost in an overflow, is found
# by listing the dir; one still changing may be half-written, and is left for
# its own CLOSE_WRITE or the next look.
QUIET_S = 2.0  # a dump unchanged this long is whole (the driver writes it in one go)


@dataclass(frozen=True)
class Scan:
    ready: tuple[str, ...]  # names to ingest now
    busy: bool  # some are still changing: look again in QUIET_S


def is_dump_name(name: str) -> bool:
    """A name the driver (or ``hangwatchd run``, for a lost dump's lines) gives what it leaves in the dump dir."""
    return name.endswith(".nvcudmp") or name.endswith(dump_names.DRIVER_LOG_SUFFIX)


def scan(directory: Path, ingested: Container[str], now: float | None = None) -> Scan:
    """The names in ``directory`` not yet ingested, split into whole and maybe still being written.

    OSError when the directory cannot be listed."""
    now = time.time() if now is None else now
    ready, busy = [], False
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path.name in ingested or not is_dump_name(path.name):
            continue  # a flight-recorder trace, the exception FIFOs' directory: never a dump, never "busy"
        try:
            quiet = now - path.lstat().st_mtime >= QUIET_S
        except OSError:
            continue  # gone already
        if quiet:
            ready.append(path.name)
        else:
            busy = True
    return Scan(tuple(ready), busy)
