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
from typing import Any, cast

import structlog

from ..analyze.verdict import analyze
from ..capture import late
from ..capture.base import Step, WindowStep
from ..capture.pipeline import Closing, Opening, Seen, capture_all, record, vetoed, whole
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
    ``Making`` does the same in turns, for a caller that must not wait between them.

    ``gone``: job-mates that had exited, each written as ``PID/exit.json`` for the verdict; with
    ``runtime_dir``, so is a target found gone when it was captured (with its launcher's exit record).
    ``beside``: files of the job as a whole (a slow job's ``slow.json``), written beside the
    processes' directories before the analysis reads them.
    With a ``spool``, a state dir without room costs the GPU dump, never the
    report: the report is kept in the spool until the state dir takes it (and
    the slow evidence is taken before it is sealed there).
    """
    making = Making(store, steps, targets, suspicion, deadline, metrics, gate, notify_status, spool, gone, node,
                    job_incident, beside, runtime_dir)
    time.sleep(max(0.0, making.look() - time.monotonic()))
    incident_id = making.finish()
    making.wait_late()
    return incident_id


class Making:
    """One incident made in turns, so that whoever runs it never waits out a window or the slow evidence:

    1. ``look()``: every step stored first (facts, stacks, NVML), and the first look of each step
       that only watches over a window (``WindowStep``: ``progress``); returns when the window has
       passed (monotonic), when ``finish`` may run;
    2. ``finish()``: the windows' second looks, the verdict, the incident stored; returns its id;
    3. the slow evidence (``capture.late``) runs on a thread of its own from the start, and is added
       to the incident once it is stored; ``then(fn)`` runs ``fn`` on that thread when it is all in
       (at once where there is none), ``wait_late()`` waits for it.

    Whatever stops a turn (it raises) abandons the draft; so does ``abandon()``.
    """

    def __init__(self, store: Store, steps: Sequence[tuple[Step, float]], targets: Sequence[Registration],
                 suspicion: Suspicion, deadline: Deadline, metrics: Metrics | None = None,
                 gate: Callable[[Path], str | None] | None = None, notify_status: str | None = None,
                 spool: Spool | None = None, gone: Sequence[exits.Departed] = (), node: str | None = None,
                 job_incident: str | None = None, beside: Mapping[str, bytes] | None = None,
                 runtime_dir: Path | None = None) -> None:
        self.store, self.spool, self.metrics = store, spool, metrics
        self.targets, self.suspicion, self.deadline = list(targets), suspicion, deadline
        self.notify_status, self.gone, self.node, self.job_incident = notify_status, gone, node, job_incident
        self.beside, self.runtime_dir = beside, runtime_dir
        self.declared = time.monotonic()
        self.job = targets[0].job if targets else None
        self.pids = [t.process.pid for t in targets]
        self.draft = begin_draft(store, spool, suspicion.reason, self.job, self.pids, metrics)
        if self.draft.spooled:
            why = "the state dir has no room: the report is kept, a GPU dump would be lost (it ends the process)"
            gate = lambda _outdir: why  # noqa: E731 - a closure named where it is used
        self.gate = gate
        first, self.later = late.split(steps)
        if self.draft.spooled:  # a spooled report is sealed once: everything goes in before
            first, self.later = list(steps), []
        self.first = first
        self.windows = [(s, t) for s, t in first if isinstance(s, WindowStep)]
        self.seen: Seen = {}  # what each window step's first look saw, by (pid, step)
        self.captures: list[ProcessCapture] = []
        self.pending: tuple[PendingEvidence, ...] = ()  # the slow evidence still coming, as first stored
        self.incident: Incident | None = None  # as first stored
        self.ended = False  # stored, or abandoned
        # The slow steps start now, beside the first stage, and add to the incident once it is stored.
        self.stored = late.Stored()
        self.refused: set[tuple[int, str]] = set()  # (pid, step): destructive steps the policy refused, said at once
        self._late_lock = threading.Lock()
        self._late_done = not self.later  # no slow steps: nothing to wait for
        self._storing = False  # the incident is being stored: the slow steps' results from now on are added after
        self._early: list[tuple[int, StepResult]] = []  # (pid, result) of slow steps in before it was stored
        self._after: list[Callable[[], None]] = []
        self.lane: threading.Thread | None = None
        if self.later:
            self.lane = threading.Thread(target=self._late, name=f"late-{self.draft.id}", daemon=True)
            self.lane.start()

    def look(self) -> float:
        """Every step stored first, and each window step's first look, on every target at once;
        returns when ``finish`` may run (monotonic): once every window has passed."""
        try:
            windows = {id(s) for s, _ in self.windows}
            steps: list[tuple[Step, float]] = [(Opening(cast(WindowStep, s), self.seen) if id(s) in windows else s, t)
                                               for s, t in self.first]
            self.captures = capture_all(steps, self.targets, self.draft.path, self.deadline, self.metrics, self.gate)
        except BaseException:
            self.abandon()
            raise
        if not self.seen:
            return time.monotonic()
        return max(at for at, _ in self.seen.values()) + max(s.window_by(self.deadline) for s, _ in self.windows)

    def finish(self) -> str:
        """The windows' second looks, the verdict, and the incident stored; its id."""
        try:
            self._close_windows()
            self._store()
        except BaseException:
            self.abandon()
            raise
        log.info("incident_stored_first", incident=self.draft.id, pids=self.pids, pending=len(self.pending),
                 seconds=round(time.monotonic() - self.declared, 3))
        self.ended = True
        if self.later and not (self.store.dir / self.draft.id).is_dir():
            # The state dir refused the commit and the report went to the spool (sealed once): the
            # slow evidence cannot be added there; the GPU dump would be lost anyway (it ends the process).
            log.error("late_evidence_not_taken", incident=self.draft.id, why="the report went to the spool")
            self.stored.set(None)
        else:
            self.stored.set(self.incident)
        return self.draft.id

    def abandon(self) -> None:
        """No incident comes of it: no half-written draft stays behind, and the slow steps stop."""
        if self.ended:
            return
        self.ended = True
        if self.draft.spooled:
            shutil.rmtree(self.draft.path, ignore_errors=True)
        else:
            self.store.abandon(self.draft)
        self.stored.set(None)

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the slow evidence is all in (on its thread), or now where it is already."""
        with self._late_lock:
            if not self._late_done:
                self._after.append(fn)
                return
        fn()

    def wait_late(self) -> None:
        if self.lane is not None:
            self.lane.join()

    def _late(self) -> None:
        try:
            _add_late(self.store, self.later, self.targets, self.draft.id, self.stored, self.refused, self.suspicion,
                      self.gate, self.metrics, self.declared, self.deadline, self._before_store)
        finally:
            with self._late_lock:
                self._late_done = True
                after, self._after = self._after, []
            for fn in after:
                fn()

    def _before_store(self, target: Registration, result: StepResult) -> bool:
        """A slow step's result that came before the incident is stored, with no files (n/a, failed:
        no flight recorder here, no NCCL): taken into the incident as first stored, which then
        says nothing is coming from it, rather than stored and amended a moment later."""
        if result.files:
            return False
        with self._late_lock:
            if self._storing:
                return False
            self._early.append((target.process.pid, result))
            return True

    def _close_windows(self) -> None:
        """Each window step's second look, on every target at once; its whole result in the place of its first half's."""
        if not self.windows:
            return
        closed = capture_all([(Closing(cast(WindowStep, s), self.seen), t) for s, t in self.windows], self.targets,
                             self.draft.path, self.deadline)
        for i, (pc, cc) in enumerate(zip(self.captures, closed)):
            second = {r.step: r for r in cc.steps}
            steps = tuple(whole(r, second[r.step]) if r.step in second else r for r in pc.steps)
            for r in steps:
                if r.step in second:
                    record(pc.registration, r, self.metrics)
            self.captures[i] = ProcessCapture(pc.registration, steps)

    def _store(self) -> None:
        targets, suspicion, draft, captures = self.targets, self.suspicion, self.draft, self.captures
        known = {d.registration.process for d in self.gone}
        late_gone = [d for d in (exits.vanished(self.runtime_dir, t) for t in targets if t.process not in known)
                     if d is not None] if self.runtime_dir is not None else []
        exits.write_into(draft.path, [*self.gone, *late_gone], targets[0] if targets else None, suspicion.since)
        # The GPU faults (XIDs) of the GPUs these ran on, and those that name them.
        gpu_events.attach(draft.path, [t.process for t in targets], suspicion.since)
        for name, data in (self.beside or {}).items():
            write_atomic(draft.path / name, data)
        with self._late_lock:  # the slow steps' results in by now go in; any later, after it is stored
            self._storing = True
            early = list(self._early)
        for i, pc in enumerate(captures):
            mine = tuple(r for pid, r in early if pid == pc.registration.process.pid)
            if mine:
                captures[i] = ProcessCapture(pc.registration, pc.steps + mine)
        taken = {(pid, r.step) for pid, r in early}
        # A GPU dump the policy refuses is not coming: said at once, in the incident as first stored.
        for i, (t, pc) in enumerate(zip(targets, captures)):
            said = [r for r in (vetoed(s, t, draft.path / str(t.process.pid), self.gate) for s, _ in self.later) if r]
            self.refused.update((t.process.pid, r.step) for r in said)
            captures[i] = ProcessCapture(pc.registration, pc.steps + tuple(said))
        until = time.time() + max((t for _, t in self.later), default=0.0) + late.HEAD_START
        skip = self.refused | taken
        self.pending = tuple(PendingEvidence(t.process.pid, s.name, until) for t in targets for s, _ in self.later
                             if (t.process.pid, s.name) not in skip)
        incident = Incident(id=draft.id, time=draft.time, host=socket.gethostname(), reason=suspicion.reason,
                            detail=suspicion.detail, job=self.job, processes=tuple(captures), signals=suspicion.signals,
                            notify_status=self.notify_status, since=suspicion.since, node=self.node,
                            job_incident=self.job_incident, pending=self.pending)
        incident, analysis_dict = _analysed(draft.path, incident)
        finish_draft(self.store, self.spool, draft, incident, _summary(incident, suspicion), analysis_dict, self.metrics)
        self.incident = incident


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
              deadline: Deadline, taken: late.Taken | None = None) -> None:
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
                  step_done, deadline, early=early, stored=stored, refused=refused, taken=taken)
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
