"""The capture pipeline: steps in order, each with a deadline, each outcome recorded."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from .. import exits
from ..metrics import Metrics
from ..model import Incident, ProcessCapture, Registration, StepResult, Suspicion
from ..analyze.verdict import analyze
from ..spool import Spool, begin_draft, finish_draft
from ..store import Store
from .base import Step, StepFailed, StepNotApplicable
from .parallel import run_across

log = structlog.get_logger("hangwatchd.capture")


def run_steps(
    steps: Sequence[tuple[Step, float]],
    target: Registration,
    outdir: Path,
    budget: float,
    metrics: Metrics | None = None,
    gate: Callable[[Path], str | None] | None = None,
) -> ProcessCapture:
    """Run each (step, timeout) on ``target`` into ``outdir``; never raises for a step's failure.

    A step gets its own timeout or what is left of ``budget``, whichever is less;
    when the budget is spent the remaining steps are skipped, and say so. A
    destructive step (the GPU dump) runs only if ``gate(outdir)`` gives no reason
    against it, after seeing what the earlier steps captured.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + budget
    results: list[StepResult] = []
    for step, timeout in steps:
        if getattr(step, "destructive", False):
            veto = gate(outdir) if gate else "no policy allows destructive steps here"
            if veto:
                results.append(StepResult(step.name, True, 0.0, f"skipped: {veto}", skipped=True))
                log.info("capture_step_skipped", pid=target.process.pid, step=step.name, why=veto)
                continue
            # A GPU dump has its own deadline: the driver needs it whatever the others took.
            left = timeout
        else:
            left = end - time.monotonic()
        if left <= 0:
            results.append(StepResult(step.name, False, 0.0, "skipped: the capture's time budget was spent", skipped=True))
            continue
        start = time.monotonic()
        try:
            files = step.run(target, outdir, min(timeout, left))
            result = StepResult(step.name, True, time.monotonic() - start, files=tuple(files))
        except StepNotApplicable as exc:  # nothing to capture here (no GPU, no process group): not a failure
            result = StepResult(step.name, True, time.monotonic() - start, str(exc), not_applicable=True)
        except StepFailed as exc:
            result = StepResult(step.name, False, time.monotonic() - start, str(exc))
        except OSError as exc:  # a full disk, a vanished directory: the step fails, the pipeline goes on
            result = StepResult(step.name, False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
        results.append(result)
        if metrics is not None:
            metrics.step_duration.labels(**metrics.labels(step=step.name)).observe(result.seconds)
            if not result.ok:
                metrics.step_failures.labels(**metrics.labels(step=step.name)).inc()
        log.info("capture_step", pid=target.process.pid, step=step.name, ok=result.ok, na=result.not_applicable,
                 seconds=round(result.seconds, 3), error=result.error, files=list(result.files))
    return ProcessCapture(target, tuple(results))


def capture_incident(
    store: Store,
    steps: Sequence[tuple[Step, float]],
    targets: Sequence[Registration],
    suspicion: Suspicion,
    budget: float,
    metrics: Metrics | None = None,
    gate: Callable[[Path], str | None] | None = None,
    notify_status: str | None = None,
    spool: Spool | None = None,
    gone: Sequence[exits.Departed] = (),
    node: str | None = None,
    job_incident: str | None = None,
) -> str:
    """Capture every target into one new incident and store it; return the incident's id.

    ``gone``: job-mates that had exited, each written as ``PID/exit.json`` for the verdict.
    With a ``spool``, a state dir without room costs the GPU dump, never the
    report: the report is kept in the spool until the state dir takes it.
    """
    job = targets[0].job if targets else None
    pids = [t.process.pid for t in targets]
    draft = begin_draft(store, spool, suspicion.reason, job, pids, metrics)
    if draft.spooled:
        why = "the state dir has no room: the report is kept, a GPU dump would be lost (it ends the process)"
        gate = lambda _outdir: why  # noqa: E731
    # Everything gentle on every rank first: a GPU dump ends its process, and a launcher
    # like torchrun then tears down the other ranks before they could be read.
    gentle = [(s, t) for s, t in steps if not getattr(s, "destructive", False)]
    last = [(s, t) for s, t in steps if getattr(s, "destructive", False)]
    def one(ss: Sequence[tuple[Step, float]], t: Registration, outdir: Path, left: float) -> ProcessCapture:
        return run_steps(ss, t, outdir, left, metrics, gate)

    captures = run_across(gentle + last, targets, lambda t: draft.path / str(t.process.pid), budget, one)
    exits.write_into(draft.path, list(gone), targets[0] if targets else None, suspicion.since)
    try:
        analysis = analyze(draft.path)
        verdict, analysis_dict = analysis.summary, analysis.to_dict()
    except Exception as exc:  # noqa: BLE001 - a capture is stored even when its analysis fails
        log.error("analysis_failed", incident=draft.id, error=f"{type(exc).__name__}: {exc}")
        verdict, analysis_dict = f"the analysis failed ({type(exc).__name__}: {exc}); the evidence is kept", None
    incident = Incident(id=draft.id, time=draft.time, host=socket.gethostname(), reason=suspicion.reason,
                        detail=suspicion.detail, job=job, processes=tuple(captures), signals=suspicion.signals,
                        notify_status=notify_status, verdict=verdict, since=suspicion.since, node=node,
                        job_incident=job_incident)
    finish_draft(store, spool, draft, incident, f"{verdict} ({suspicion.detail})", analysis_dict, metrics)
    return draft.id
