"""A hang made into an incident: capture, then analyse, then store, the three stages in their order;
then the slow evidence, added to the stored incident as it comes.

The capture stage knows nothing of the stages after it: it writes what it took
into a directory it is given. This module, above them, hands it the store's
draft directory, asks the analysis for a verdict on what was written, and
commits the incident. The daemon and ``hangwatchd capture`` both come here.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from ..analyze.verdict import analyze
from ..capture import late
from ..capture.base import Step
from ..capture.pipeline import capture_all, vetoed
from ..host import gpu_events
from ..host.atomic import write_atomic
from ..host.deadline import Deadline
from ..incidents.spool import Spool, begin_draft, finish_draft
from ..incidents.store import COMING, LATE_DIR, Store, StoreWriteError, incident_to_json
from ..metrics import Metrics
from ..model import (
    Incident,
    PendingEvidence,
    ProcessCapture,
    Registration,
    StepResult,
    Suspicion,
)
from ..report import html
from ..workload import exits

log = structlog.get_logger("hangwatchd.capture")


def make_incident(
    store: Store,
    steps: Sequence[tuple[Step, float]],
    targets: Sequence[Registration],
    suspicion: Suspicion,
    deadline: Deadline,
    metrics: Metrics | None = None,
    gate: Callable[[Path], str | None] | None = None,
    notify_status: str | None = None,
    spool: Spool | None = None,
    gone: Sequence[exits.Departed] = (),
    node: str | None = None,
    job_incident: str | None = None,
    beside: Mapping[str, bytes] | None = None,
    runtime_dir: Path | None = None,
) -> str:
    """Capture every target into one new incident and store it, by ``deadline`` (the capture's one,
    set when the hang was declared, handed to every step unchanged); return the incident's id.

    The incident is stored once every target's facts and stacks are in; the slow
    evidence (flight recorders, GPU dumps: ``capture.late``) is added to it as each
    rank's arrives, each under its own deadline, and the report says what is still
    coming until then. Returns when everything has come or passed its deadline.

    ``gone``: job-mates that had exited, each written as ``PID/exit.json`` for the verdict; with
    ``runtime_dir``, so is a target found gone when it was captured (with its launcher's exit record).
    ``beside``: files of the job as a whole (a slow job's ``slow.json``), written beside the
    processes' directories before the analysis reads them.
    With a ``spool``, a state dir without room costs the GPU dump, never the
    report: the report is kept in the spool until the state dir takes it (and
    the slow evidence is taken before it is sealed there).
    """
    declared = time.monotonic()
    job = targets[0].job if targets else None
    pids = [t.process.pid for t in targets]
    draft = begin_draft(store, spool, suspicion.reason, job, pids, metrics)
    if draft.spooled:
        why = "the state dir has no room: the report is kept, a GPU dump would be lost (it ends the process)"
        gate = lambda _outdir: why  # noqa: E731 - a closure named where it is used
    first, later = late.split(steps)
    if draft.spooled:  # a spooled report is sealed once: everything goes in before
        first, later = list(steps), []
    # The slow steps start now, beside the first stage, and add to the incident once it is stored.
    stored = late.Stored()
    refused: set[tuple[int, str]] = set()  # (pid, step): destructive steps the policy refused, said at once
    lane = None
    if later:
        lane = threading.Thread(target=_add_late, name=f"late-{draft.id}", daemon=True,
                                args=(store, later, targets, draft.id, stored, refused, suspicion, gate, metrics,
                                      declared, deadline))
        lane.start()
    try:
        captures = capture_all(first, targets, draft.path, deadline, metrics, gate)
        known = {d.registration.process for d in gone}
        late_gone = [d for d in (exits.vanished(runtime_dir, t) for t in targets if t.process not in known)
                     if d is not None] if runtime_dir is not None else []
        exits.write_into(draft.path, [*gone, *late_gone], targets[0] if targets else None, suspicion.since)
        # The GPU faults (XIDs) of the GPUs these ran on, and those that name them.
        gpu_events.attach(draft.path, [t.process for t in targets], suspicion.since)
        for name, data in (beside or {}).items():
            write_atomic(draft.path / name, data)
        # A GPU dump the policy refuses is not coming: said at once, in the incident as first stored.
        for i, (t, pc) in enumerate(zip(targets, captures)):
            said = [r for r in (vetoed(s, t, draft.path / str(t.process.pid), gate) for s, _ in later) if r]
            refused.update((t.process.pid, r.step) for r in said)
            captures[i] = ProcessCapture(pc.registration, pc.steps + tuple(said))
        until = time.time() + max((t for _, t in later), default=0.0) + late.HEAD_START
        pending = tuple(PendingEvidence(t.process.pid, s.name, until) for t in targets for s, _ in later
                        if (t.process.pid, s.name) not in refused)
        incident = Incident(id=draft.id, time=draft.time, host=socket.gethostname(), reason=suspicion.reason,
                            detail=suspicion.detail, job=job, processes=tuple(captures), signals=suspicion.signals,
                            notify_status=notify_status, since=suspicion.since, node=node,
                            job_incident=job_incident, pending=pending)
        incident, analysis_dict = _analysed(draft.path, incident)
        finish_draft(store, spool, draft, incident, _summary(incident, suspicion), analysis_dict, metrics)
    except BaseException:
        # Whatever stopped it before the incident was stored: no half-written draft stays behind.
        if draft.spooled:
            shutil.rmtree(draft.path, ignore_errors=True)
        else:
            store.abandon(draft)
        stored.set(None)
        raise
    log.info("incident_stored_first", incident=draft.id, pids=pids, pending=len(pending),
             seconds=round(time.monotonic() - declared, 3))
    if later and not (store.dir / draft.id).is_dir():
        # The state dir refused the commit and the report went to the spool (sealed once): the
        # slow evidence cannot be added there; the GPU dump would be lost anyway (it ends the process).
        log.error("late_evidence_not_taken", incident=draft.id, why="the report went to the spool")
        stored.set(None)
    else:
        stored.set(incident)
    if lane is not None:
        lane.join()
    return draft.id


def _analysed(directory: Path, incident: Incident) -> tuple[Incident, dict[str, Any] | None]:
    """The incident with its verdict on what ``directory`` holds now, and the pages rendered into it."""
    try:
        analysis = analyze(directory)
        verdict, analysis_dict = analysis.summary, analysis.to_dict()
    except Exception as exc:  # a capture is stored even when its analysis fails
        log.error("analysis_failed", incident=incident.id, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        verdict, analysis_dict = f"the analysis failed ({type(exc).__name__}: {exc}); the evidence is kept", None
    incident = dataclasses.replace(incident, verdict=verdict)
    if analysis_dict is not None:
        write_pages(directory, incident, analysis_dict)
    return incident, analysis_dict


def _summary(incident: Incident, suspicion: Suspicion) -> str:
    """The index row's one line: the verdict, the suspicion, and what is still coming."""
    line = f"{incident.verdict} ({suspicion.detail})"
    return f"{line}{COMING}{coming(incident)}" if incident.pending else line


def coming(incident: Incident) -> str:
    """What is still coming, in a few words: "flight_recorder of 2 ranks, cuda_dump of 2 ranks"."""
    by_step: dict[str, int] = {}
    for p in incident.pending:
        by_step[p.step] = by_step.get(p.step, 0) + 1
    return ", ".join(f"{step} of {n} rank{'s' if n > 1 else ''}" for step, n in by_step.items())


def _add_late(store: Store, steps: Sequence[tuple[Step, float]], targets: Sequence[Registration], incident_id: str,
              stored: late.Stored, refused: set[tuple[int, str]], suspicion: Suspicion,
              gate: Callable[[Path], str | None] | None, metrics: Metrics | None, declared: float,
              deadline: Deadline) -> None:
    """Run the slow steps on every rank and add each piece of evidence to the incident as it comes,
    once it is stored (``stored`` says when, and with what); ``refused`` (pid, step): not run, the
    stored incident says so already (filled in before ``stored`` is set).

    Files move in at once, under a lock; the verdict is then made again and incident.json,
    the pages and the index row rewritten by one thread at a time, which goes on while more
    came meanwhile: eight ranks' dumps arriving together cost a few analyses, not sixteen."""
    lock = threading.Lock()
    state: dict[str, Any] = {"incident": None, "dirty": False, "analysing": False}
    final = store.dir / incident_id
    uids: list[int | None] = [t.uid for t in targets]

    def late_gate(outdir: Path) -> str | None:  # the policy sees the rank's stored evidence, not the late dir
        pid = outdir.name.removeprefix(LATE_DIR).rsplit("-", 2)[1]  # .late-ID-PID-STEP
        return gate(final / pid) if gate else "no policy allows destructive steps here"

    def settle() -> None:
        """Re-analyse and rewrite until nothing new came meanwhile; one thread at a time does it."""
        with lock:
            if state["analysing"]:
                return  # the one at it picks this up
            state["analysing"] = True
        try:
            while True:
                with lock:
                    if not state["dirty"]:
                        state["analysing"] = False  # in the same breath as the look: nothing slips between
                        return
                    state["dirty"] = False
                    snapshot = state["incident"]
                cur, analysis = _analysed(final, snapshot)
                try:
                    store.amend(incident_id, cur, _summary(cur, suspicion), analysis)
                except StoreWriteError as exc:
                    log.error("late_evidence_not_kept", incident=incident_id, error=str(exc))
                with lock:
                    state["incident"] = dataclasses.replace(state["incident"], verdict=cur.verdict)
        except BaseException:
            with lock:
                state["analysing"] = False
            raise

    def current() -> Incident:
        """The incident as amended so far (under the lock); the stored one at first."""
        if state["incident"] is None:
            state["incident"] = stored.wait()
        return state["incident"]

    def step_done(target: Registration, outdir: Path, result: StepResult) -> None:
        pid = target.process.pid
        with lock:
            try:
                store.add_files(incident_id, pid, outdir, uids)
            except StoreWriteError as exc:
                log.error("late_evidence_not_kept", incident=incident_id, pid=pid, error=str(exc))
                if result.files:
                    result = dataclasses.replace(result, ok=False, files=(), error=f"not kept: {exc}")
            cur = current()
            procs = tuple(ProcessCapture(pc.registration, pc.steps + (result,))
                          if pc.registration.process.pid == pid else pc for pc in cur.processes)
            still = tuple(p for p in cur.pending if (p.pid, p.step) != (pid, result.step))
            state["incident"] = dataclasses.replace(cur, processes=procs, pending=still)
            state["dirty"] = True
        settle()
        log.info("incident_amended", incident=incident_id, pid=pid, step=result.step,
                 seconds=round(time.monotonic() - declared, 3), still_coming=len(still),
                 outcome="n/a" if result.not_applicable else "ok" if result.ok else result.error)

    def early(target: Registration, outdir: Path) -> None:  # a GPU dump symbolised, its compression to come
        pid = target.process.pid
        with lock:
            try:
                moved = store.add_files(incident_id, pid, outdir, uids, more=True)
            except StoreWriteError as exc:
                log.error("late_evidence_not_kept", incident=incident_id, pid=pid, error=str(exc))
                return
            current()
            state["dirty"] = True
        settle()
        log.info("incident_amended", incident=incident_id, pid=pid, step=outdir.name.rsplit("-", 1)[-1], files=moved,
                 seconds=round(time.monotonic() - declared, 3), outcome="partial")

    late.run_late(steps, targets, lambda t, step: store.late_dir(incident_id, t.process.pid, step), late_gate, metrics,
                  step_done, deadline, early=early, stored=stored, refused=refused)
    if stored.wait() is not None:
        settle()  # whatever a thread that returned early left for the last one


def write_pages(draft_dir: Path, incident: Incident, analysis: dict[str, Any]) -> None:
    """The pages a person opens (report.html), rendered once into the draft so they arrive with it;
    the store only moves them. A page that cannot be made costs the page, never the incident."""
    try:
        for name, text in html.pages(draft_dir, analysis, incident_to_json(incident)).items():
            write_atomic(draft_dir / name, text.encode())
    except Exception as exc:  # a renderer's bug must not lose the evidence
        log.error("incident_page_failed", dir=str(draft_dir), error=f"{type(exc).__name__}: {exc}", exc_info=True)
