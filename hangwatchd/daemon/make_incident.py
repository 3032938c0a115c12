"""A hang made into an incident: capture, then analyse, then store, the three stages in their order.

The capture stage knows nothing of the stages after it: it writes what it took
into a directory it is given. This module, above them, hands it the store's
draft directory, asks the analysis for a verdict on what was written, and
commits the incident. The daemon and ``hangwatchd capture`` both come here.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from ..analyze.verdict import analyze
from ..capture.base import Step
from ..capture.pipeline import capture_all
from ..host import gpu_events
from ..incidents.spool import Spool, begin_draft, finish_draft
from ..incidents.store import Store, incident_to_json
from ..metrics import Metrics
from ..model import Incident, Registration, Suspicion
from ..report import html
from ..workload import exits

log = structlog.get_logger("hangwatchd.capture")


def make_incident(
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
    captures = capture_all(steps, targets, draft.path, budget, metrics, gate)
    exits.write_into(draft.path, list(gone), targets[0] if targets else None, suspicion.since)
    gpu_events.attach(draft.path, pids, suspicion.since)  # the GPU faults (XIDs) of the GPUs these ran on
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
    if analysis_dict is not None:
        write_pages(draft.path, incident, analysis_dict)
    finish_draft(store, spool, draft, incident, f"{verdict} ({suspicion.detail})", analysis_dict, metrics)
    return draft.id


def write_pages(draft_dir: Path, incident: Incident, analysis: dict[str, Any]) -> None:
    """The pages a person opens (report.html), rendered once into the draft so they arrive with it;
    the store only moves them. A page that cannot be made costs the page, never the incident."""
    try:
        for name, text in html.pages(draft_dir, analysis, incident_to_json(incident)).items():
            tmp = draft_dir / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(draft_dir / name)
    except Exception as exc:  # noqa: BLE001 - a renderer's bug must not lose the evidence
        log.error("incident_page_failed", dir=str(draft_dir), error=f"{type(exc).__name__}: {exc}", exc_info=True)
