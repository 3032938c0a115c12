"""An exception dump (or a driver's report without one) found in the dump dir, made into one incident.

The dump dir is world-writable: a file there says whose it is only by its
owner, never by its name. It is opened once through ``untrusted`` (a link, a
FIFO or a directory is refused before anything is read) and linked to the pid
its name carries only when that process runs as the file's owner. A file naming
another user's process is filed as its owner's, against no process, and does
not count as that process's GPU exception.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import gpudump, procfs, untrusted
from .cudacore import driverlog
from .metrics import Metrics
from .model import Incident, ProcessCapture, ProcessId, Registration, StepResult
from .spool import Spool, begin_draft, finish_draft
from .store import Store


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
    note = (f"written by uid {owner} but names pid {pid}, which runs as "
            f"{'uid ' + str(runs_as) if runs_as is not None else 'mixed uids'}: not linked to it")
    return Attribution(Registration(ProcessId(0, 0), uid=owner), False, note)


def ingest(store: Store, path: Path, pid: int | None, claimed: Registration | None, driver_logs: Path,
           count: Callable[[str], None], spool: Spool | None = None, metrics: Metrics | None = None) -> str:
    """Make ``path`` into an incident and return its id; ``count(type)`` is called for a linked
    exception. Raises untrusted.Refused (nothing is filed) when the file is not a regular file.

    With a ``spool``, a state dir without room keeps the report there (and the raw dump
    where it lies) until it has room."""
    start = time.monotonic()
    is_log = path.name.endswith(gpudump.DRIVER_LOG_SUFFIX)
    fd = untrusted.open_fd(path, None, max_size=gpudump.MAX_TEXT if is_log else gpudump.MAX_DUMP)
    try:
        st = os.fstat(fd)
        who = attribute(st.st_uid, pid, claimed)
        reg = who.registration
        linked_pid = reg.process.pid if who.linked and reg.process.pid else None
        draft = begin_draft(store, spool, "gpu-exception", reg.job, [linked_pid] if linked_pid else [], metrics)
        outdir = draft.path / str(linked_pid or "unknown")
        outdir.mkdir(parents=True)
        if is_log:
            lines = untrusted.read_fd(fd, path, gpudump.MAX_TEXT, 10.0).decode("utf-8", "replace").splitlines()
            report = driverlog.parse(lines)
            (outdir / "driver.log").write_text("\n".join(lines) + "\n")
            gpudump.unlink_same(path, st)
            step = StepResult("driver_log", True, time.monotonic() - start, who.note, files=("driver.log",))
            detail = f"the driver reported {report.summary()} but wrote no dump"
            exc_type = report.exception or "UNKNOWN"
        else:
            stored = gpudump.store_fd(fd, path, outdir, remove_source=True, keep_dump=not draft.spooled)
            files = list(stored.files)
            # The launcher's record of this pid's driver lines, only when it is the same user's.
            if linked_pid and gpudump.copy_text(driver_logs / f"{linked_pid}.log", outdir / "driver.log", reg.uid):
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
    finish_draft(store, spool, draft, incident, f"gpu-exception: {detail}", metrics=metrics)
    try:
        store.mark_ingested(path.name)
    except Exception:  # noqa: BLE001 - remembered in the daemon's memory for this run; a full index forgets it
        pass
    return draft.id


def describe(sym: object, name: str, note: str | None) -> tuple[str, str]:
    """One line for an exception dump: what, in which kernel, where; and the exception type."""
    from .cudacore.symbolize import Symbolized

    if not isinstance(sym, Symbolized):
        return f"{name}: {note or 'unreadable dump'}", "UNREADABLE"
    for e in sym.exceptions:
        where = next((f" at {f.file}:{f.line}" for f in e.frames if f.file), "")
        return f"{e.type} in {e.kernel or 'an unknown kernel'}{where}", e.type
    kernels = ", ".join(k.name for k in sym.kernels) or "no running kernel"
    return f"GPU coredump with no exception ({kernels})", "NONE"
