"""A GPU exception caught while its process still waits: the stacks first, then the dump, one incident.

The driver began writing a process's exception dump into the daemon's FIFO
(``host.dump_fifos``: ``ExceptionBegun``), and its thread now waits, blocked in
``write``, in the call where the error surfaced. Two short jobs on the capture
workers, with the FIFO's own thread between them, so no worker waits for the
driver:

1. ``look``: a draft incident; the process's ``/proc`` facts and its Python and
   native stacks of every thread (the configured ``proc`` and ``pyspy`` steps),
   taken while the process cannot move; then the FIFO's thread is asked to drain
   the dump into the draft (``ExceptionLooked`` tells the loop which draft).
2. ``file``: once drained (``ExceptionDrained``), the dump symbolised and
   compressed as any dump (``capture.dump_artifacts``: the sandbox, the
   capture's one deadline), what went wrong said in one line, the verdict made,
   the incident committed.

A FIFO that gave something other than a CUDA coredump (its owner wrote into it)
costs no stacks: its incident says what came. Where the state dir has no room,
the dump is not read (the FIFO is let go: the driver's write fails) and the
report says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from ..analyze import evidence, surfaced
from ..analyze.verdict import analyze
from ..capture.base import Step
from ..capture.dump_artifacts import Stored, copy_text, store_fd
from ..capture.pipeline import run_steps
from ..cudacore.symbolize import Symbolized
from ..host import source_lines, untrusted
from ..host.deadline import Deadline
from ..host.dump_fifos import ExceptionBegun, ExceptionDrained, ExceptionFifos
from ..incidents.spool import Spool, begin_draft, finish_draft
from ..incidents.store import Draft, Store
from ..metrics import Metrics, exception_type
from ..model import Incident, ProcessCapture, Registration, StepResult
from ..workload.runtime_files import driver_log
from . import exception_dumps
from .make_incident import write_pages

log = structlog.get_logger("hangwatchd.daemon")

CODE_TIMEOUT = 2.0  # seconds to read the lines the verdict quotes, while the driver waits
# What is taken while the driver waits: facts and stacks, then the process's own report (its reporter
# runs while the waiting thread holds no GIL), which says where each thread last replayed a CUDA graph.
STEPS = ("proc", "pyspy", "introspect")
RAW = "coredump.nvcudmp"  # the drained dump in the draft, until it is compressed
FILE_RESERVE = 30.0  # seconds (at most a quarter of what is left) held back from the drain for symbolising and compressing


@dataclass(frozen=True)
class ExceptionLooked:
    """The stacks are in the draft and the drain is asked for (or, with ``error``, nothing will come)."""

    capture: int
    draft: Draft | None
    captured: ProcessCapture | None
    error: str | None = None


def look(capture: int, begun: ExceptionBegun, steps: list[tuple[Step, float]], deadline: Deadline, store: Store,
         spool: Spool | None, metrics: Metrics | None) -> ExceptionLooked:
    """On a worker: the draft and the stacks (only of a real dump's writer). The loop then asks for
    the drain (``drain_into``): so the drain's end always follows this on the loop's queue."""
    reg = begun.registration
    pid = reg.process.pid
    draft = begin_draft(store, spool, "gpu-exception", reg.job, [pid], metrics)
    try:
        outdir = draft.path / str(pid)
        outdir.mkdir(parents=True, exist_ok=True)
        chosen = [(s, t) for s, t in steps if s.name in STEPS] if begun.coredump else []
        refused = None
        if chosen:
            try:  # a program below that exec'd a setuid one since its FIFO was made is not read for its user
                untrusted.check_owner(pid, reg.uid)
            except untrusted.Refused as exc:
                chosen, refused = [], StepResult("proc", False, 0.0, f"not read: {exc}")
        captured = run_steps(chosen, reg, outdir, deadline, metrics)
        if refused is not None:
            captured = ProcessCapture(captured.registration, captured.steps + (refused,))
        if chosen:
            try:
                read_code(reg, outdir, deadline.cut(CODE_TIMEOUT))
            except Exception as exc:  # the quoted line is a nicety: its trouble costs it alone
                log.warning("code_not_read", pid=pid, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    except BaseException:
        abandon(store, draft)
        raise
    log.info("exception_looked", pid=pid, incident=draft.id, steps=[s.step for s in captured.steps],
             seconds_since_begun=round(time.time() - begun.since, 3))
    return ExceptionLooked(capture, draft, captured)


def read_code(reg: Registration, outdir: Path, deadline: Deadline) -> None:
    """code.json: the lines of the program's own frames in the thread where the exception surfaced
    (the verdict quotes them), read as the process's user; nothing where none could be read."""
    ev = evidence.read(outdir)
    at = surfaced.in_evidence(ev.threads, ev.report)
    if at is None:
        return
    frames = [at.frame] + [f for f in (at.graph, at.replay) if f is not None and f is not at.frame]
    wanted = [(str(f.get("filename") or ""), int(f.get("line") or 0)) for f in frames]
    lines = source_lines.read(reg.process.pid, reg.uid, wanted, deadline.at)
    if lines:
        (outdir / evidence.CODE_FILE).write_text(json.dumps({"lines": lines}, indent=1))


def drain_into(fifos: ExceptionFifos, begun: ExceptionBegun, looked: ExceptionLooked, deadline: Deadline) -> None:
    """Ask the FIFO's thread for the dump: into the draft, or let go (the driver's write fails) where
    there is no draft or it went to the spool (a full state dir: the report is kept, the dump is not)."""
    process = begun.registration.process
    if looked.draft is None or looked.error:
        fifos.drain(process, None, deadline.at, f"the stacks could not be taken ({looked.error}): the dump was not read")
    elif looked.draft.spooled:
        fifos.drain(process, None, deadline.at, "the state dir has no room: the dump was not read (the report is kept)")
    else:
        # The drain ends early enough for what came to be symbolised and compressed by the deadline.
        keep = min(FILE_RESERVE, deadline.left() / 4)
        fifos.drain(process, looked.draft.path / str(process.pid) / RAW, deadline.sooner(keep).at)


def abandon(store: Store, draft: Draft) -> None:
    """A draft that will never be an incident: removed."""
    if draft.spooled:
        shutil.rmtree(draft.path, ignore_errors=True)
    else:
        store.abandon(draft)


def file(begun: ExceptionBegun, drained: ExceptionDrained, draft: Draft, captured: ProcessCapture, deadline: Deadline,
         store: Store, spool: Spool | None, driver_logs: Path, metrics: Metrics | None, node: str | None) -> str:
    """On a worker: the drained dump made into symbolized.json and coredump.nvcudmp.zst, the
    incident's step for it, the verdict; the incident committed. Returns its id."""
    try:
        return _file(begun, drained, draft, captured, deadline, store, spool, driver_logs, metrics, node)
    except BaseException:
        abandon(store, draft)
        raise


def _file(begun: ExceptionBegun, drained: ExceptionDrained, draft: Draft, captured: ProcessCapture, deadline: Deadline,
          store: Store, spool: Spool | None, driver_logs: Path, metrics: Metrics | None, node: str | None) -> str:
    reg = begun.registration
    pid = reg.process.pid
    outdir = draft.path / str(pid)
    start = time.monotonic()
    raw = outdir / RAW
    stored: Stored | None = None
    if drained.path and drained.size and begun.coredump and drained.outcome in ("whole", "short", "cap", "deadline"):
        fd = os.open(raw, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # our own file, in our draft
        try:
            stored = store_fd(fd, raw, outdir, remove_source=True, deadline=deadline.at)
        except (untrusted.Refused, OSError) as exc:  # the dump's trouble costs the dump, never the incident: said in it
            stored = Stored((), None, str(exc))
        finally:
            os.close(fd)
    raw.unlink(missing_ok=True)
    files = list(stored.files) if stored else []
    if copy_text(driver_log(driver_logs, reg.uid, pid), outdir / "driver.log", reg.uid):
        files.append("driver.log")
    notes = [n for n in (begun.note, drained.note, stored.note if stored else None) if n]
    symbolized = stored.symbolized if stored else None
    if symbolized is None and not notes:
        notes.append("the dump could not be read")
    step = StepResult("cuda_exception", symbolized is not None, time.monotonic() - start, "; ".join(notes) or None,
                      tuple(files))
    detail, exc_type = describe(begun, drained, symbolized)
    if metrics is not None and symbolized is not None:
        metrics.gpu_exceptions.labels(**metrics.labels(type=exception_type(exc_type))).inc()
    incident = Incident(id=draft.id, time=draft.time, host=socket.gethostname(), reason="gpu-exception", detail=detail,
                        job=reg.job, processes=(ProcessCapture(reg, captured.steps + (step,)),), since=begun.since,
                        node=node)
    verdict, analysis = f"pid {pid}: {detail}.", None
    try:
        result = analyze(draft.path)
        analysis = result.to_dict()
        if any(r.verdict == "gpu-exception" for r in result.ranks):
            verdict = result.summary
        else:  # no exception read from the dump: what it stopped at is said, and where it surfaced, not what the stacks look like
            ev = evidence.read(outdir)
            at = surfaced.in_evidence(ev.threads, ev.report)
            verdict = f"pid {pid}: GPU exception ({detail})" + (f", surfaced in {at.text()}." if at else ".")
    except Exception as exc:  # a capture is stored even when its analysis fails
        log.error("analysis_failed", incident=draft.id, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    incident = dataclasses.replace(incident, verdict=verdict)
    if analysis is not None:
        write_pages(draft.path, incident, analysis)
    finish_draft(store, spool, draft, incident, f"gpu-exception: {verdict}", analysis, metrics)
    return draft.id


def describe(begun: ExceptionBegun, drained: ExceptionDrained, symbolized: Symbolized | None) -> tuple[str, str]:
    """The incident's detail line and the exception's type (for the metric)."""
    name = os.path.basename(begun.fifo)
    if not begun.coredump:
        return f"{name}: {begun.note or 'not a CUDA coredump'}", "UNREADABLE"
    if symbolized is None:
        return f"{name}: the driver began an exception's dump ({drained.note or 'unreadable'})", "UNREADABLE"
    return exception_dumps.describe(symbolized, name, drained.note)
