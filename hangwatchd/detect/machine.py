"""The state machine of one watched process: healthy -> suspect -> hung -> captured, and back.

One signal makes a process suspect (a beat that does not come, a stack that
does not move); a second look confirms or drops the suspicion before anything
destructive happens. A beat that pauses under a learned timeout needs a still
stack too; a frozen stack counts only when it is blocked on something that
should come (the GPU, a collective, a lock), not idle waiting for work, unless
the user declared ``--stack-timeout``.

A confirmed hang is handed over as a transaction: every rank of the same job
here goes with it (``job_mates``), the machine returns a ``Declare`` that the
loop turns into a queued capture, and only then (``handed_over``) is the
state HUNG; a capture that fails before its incident is stored (or that could
not be queued) is tried again after a bounded pause, with the job-mates that
wait likewise, so no process is left HUNG without a capture coming. A captured
process is declared again only after progress it could not fake while hung
(``rearm``).

The machine does no I/O but its looks (the detector reads a beat segment) and
calls nobody back: each entry point returns what is to be done (``Declare``,
``Drop``) for the loop to do, and every change of a process goes through
``Watchlist.change``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from ..config import Config
from ..host import untrusted
from ..host.deadline import Deadline
from ..metrics import Metrics
from ..model import State, Suspicion
from ..watch.stack_history import Sample, StackHistory
from ..watch.watched import INTERVALS_KEEP, Watched, Watchlist, job_mates
from . import rearm, working
from .base import Detector
from .sampler import SampleTaken
from .stack import classify

log = structlog.get_logger("hangwatchd.daemon")

ERROR_BACKOFF = 5.0  # a process whose handling failed is looked at again after this, not at once
RETRY_FIRST = 5.0  # a failed capture of a hang is tried again after this, doubling each time ...
RETRY_MAX = 300.0  # ... up to this
HUNG_LOOK = 5.0  # a hung or captured process is looked at this often (for progress, for a retry)
MIN_GAP = 0.2  # seconds: the soonest a plain sample follows the last
# A Python thread on the CPU whose locals read the same: this many samples of its still stack before a
# paused beat counts as hung. py-spy reads a running frame's locals torn (a counter's block already
# reused by another object: "<range at 0x..>", "+bigint"), and three torn reads can match.
RUNNING_SAMPLES = 5
TIMEOUT_SHOWN_MOVE = 0.1  # a learned timeout that moves less than this share of itself is shown at the next regular rewrite

@dataclass(frozen=True)
class Declare:
    """Capture ``group`` (a hung process and its job-mates) by ``deadline``; then ``handed_over``."""

    group: tuple[Watched, ...]
    suspicion: Suspicion
    deadline: Deadline  # the capture's one deadline, from the declaration to its last step
    job_incident: str | None = None  # another node's job incident this capture joins
    requested: str | None = None  # the action another node's capture request carried
    retry: bool = False  # a failed capture of a hang declared before, tried again


@dataclass(frozen=True)
class Drop:
    """Its files were swapped after it was admitted: the registration is dropped (``Registrations.tampered``)."""

    watched: Watched
    refused: untrusted.Refused


Decision = Declare | Drop


def retry_pause(attempts: int) -> float:
    return min(RETRY_MAX, RETRY_FIRST * 2 ** max(0, attempts - 1))


class StateMachine:
    def __init__(self, cfg: Config, detector: Detector, watched: Watchlist, metrics: Metrics,
                 blocking: Sequence[str], idle: str, capture_budget: float | None = None) -> None:
        self.cfg = cfg
        # Seconds from a declaration to its capture's deadline (capture.capture_budget: the GPU dump's time included).
        self.capture_budget = capture_budget if capture_budget is not None else cfg.capture_timeout
        self.detector = detector
        self.watched = watched
        self.metrics = metrics
        self.blocking = blocking
        self.idle = idle
        self._out: list[Decision] = []  # what the entry point being run decided, for the loop to do
        self._looked = metrics.passes.labels(**metrics.labels(what="look"))
        self._gap = metrics.sample_gap.labels(**metrics.const)

    def _decided(self) -> list[Decision]:
        out, self._out = self._out, []
        return out

    # -- looks ---------------------------------------------------------------

    def observe(self, w: Watched, now: float) -> list[Decision]:
        """Its detector's look, due now: move its state on, or note when to look again."""
        try:
            self._observe(w, now)
        except BaseException:
            self._out = []
            raise
        return self._decided()

    def _observe(self, w: Watched, now: float) -> None:
        self._looked.inc()
        try:
            w.check_files()
            obs = self.detector.observe(w, now)
        except untrusted.Refused as exc:
            self._out.append(Drop(w, exc))
            return
        if obs.learned:
            shown = (w.timeout, w.timeout_source)
            self.watched.change(w, **obs.learned)
            if "timeout" in obs.learned and (w.timeout_source != shown[1]
                                             or abs(w.timeout - shown[0]) >= TIMEOUT_SHOWN_MOVE * shown[0]):
                # Learned, or moved to another phase's: status.json shows it now (debounced). Each look
                # moves it a little: 1,000 processes' looks rewrote it every second (bench/scale.py),
                # where its regular rewrite (status_file.STATUS_EVERY) shows those.
                self.watched.on_change()
        r = w.registration
        self._export(w)
        sample_at = now if w.watched_by_stack and w.next_sample == float("inf") else None  # e.g. it never beat
        if w.state in (State.HUNG, State.CAPTURED):
            if self._rearm_if_progressed(w, now):
                return
            if w.state is State.HUNG and w.retry_at is not None and now >= w.retry_at:
                self._retry(w, now)
                return
            look = now + min(w.timeout, HUNG_LOOK)
            self.watched.change(w, check_at=min(look, w.retry_at) if w.retry_at is not None else look, sample_at=sample_at)
            return
        if obs.state is State.SUSPECT:
            if w.state is not State.SUSPECT:
                self._suspect(w, obs.suspicion, now)
            elif now >= w.confirm_by:
                self._confirm(w, now)
            if w.state is State.SUSPECT:
                self.watched.change(w, check_at=max(now + 0.1, min(w.confirm_by, now + 1.0)))
            return
        if w.state is State.SUSPECT and w.suspicion and w.suspicion.reason == "heartbeat":
            log.info("suspicion_dropped", pid=r.process.pid, why="a beat came")
            self.watched.change(w, obs.state, why="a beat came", suspicion=None, check_at=obs.next_check, sample_at=sample_at)
            return
        keep = w.state is State.SUSPECT and w.suspicion is not None  # a stack suspicion: the native look decides
        if keep and now >= w.confirm_by and w.history.samples:
            # Its native look never came back (py-spy refused, the user's budget spent): judge the plain one.
            self._judge_native(w, w.history.samples[-1], now)
            return
        self.watched.change(w, None if keep else obs.state, why="detector", check_at=obs.next_check, sample_at=sample_at)

    def _export(self, w: Watched) -> None:
        """Its timeout and last beat on /metrics, set when they change (the series looked up once)."""
        if w.series is None:
            r = w.registration
            values = (*self.metrics.const.values(), r.job or "", str(r.rank if r.rank is not None else ""), str(r.process.pid))
            w.series = (self.metrics.timeout.labels(*values), self.metrics.last_beat.labels(*values), None, None)
        timeout_g, beat_g, timeout_set, beat_set = w.series
        count = w.beat.count if w.beat is not None else 0
        if w.timeout != timeout_set or (count and count != beat_set):
            timeout_g.set(w.timeout)
            if w.beat is not None and count and count != beat_set:
                beat_g.set(w.beat.wall_time() or 0)
            w.series = (timeout_g, beat_g, w.timeout, count or beat_set)

    def _suspect(self, w: Watched, suspicion: Suspicion | None, now: float) -> None:
        """One signal says stalled. Confirm before anything is done about it."""
        assert suspicion is not None
        log.info("process_suspect", pid=w.process.pid, reason=suspicion.reason, detail=suspicion.detail)
        if suspicion.reason == "heartbeat" and w.timeout_source == "learned":
            # A learned timeout may only mean a new phase: the stack must hold still too.
            self.watched.change(w, State.SUSPECT, why="heartbeat", suspicion=suspicion, reset_history=True,
                                confirm_by=now + max(3.0, min(10.0, w.timeout / 2)), sample_at=now)
        else:
            self.watched.change(w, State.SUSPECT, why=suspicion.reason, suspicion=suspicion,
                                confirm_by=now + 0.5)  # a declared timeout: one more look, then act

    def _confirm(self, w: Watched, now: float) -> None:
        suspicion = w.suspicion
        assert suspicion is not None
        signals = set(suspicion.signals)
        if w.history.frozen_for() >= 2.0:
            signals.add("stack")
        why_not = None
        if suspicion.reason == "heartbeat" and w.timeout_source == "learned":
            # Beats that pause under a learned timeout may be a new phase: the process is judged by
            # what it did meanwhile (the CPU it had and waited for, bytes, children), not a fixed share.
            if "stack" not in signals:
                why_not = "the stack moved"
            else:
                why_not = self._working(w, None, False)
        if why_not:
            # The beats paused but the process works: a new phase, not a hang. Learn the longer gap.
            log.info("suspicion_dropped", pid=w.process.pid, why=why_not, paused=round(now - (w.last_progress or now), 1))
            self.watched.change(w, State.HEALTHY, why=why_not, suspicion=None, last_progress=now,
                                intervals=(*w.intervals[-(INTERVALS_KEEP - 1):], now - (w.last_progress or now)),
                                sample_at=float("inf") if not w.watched_by_stack else now + self.cfg.stack_interval)
            return
        if w.beat is not None and w.last_progress is not None and suspicion.reason == "stack":
            if now - w.last_progress > w.timeout:
                signals.add("heartbeat")
        evidence = f"; {w.history.evidence()}" if w.history.samples and "stack" in signals else ""
        self._hung(w, Suspicion(suspicion.reason, suspicion.detail + evidence, suspicion.since, tuple(sorted(signals))), now)

    def sample_taken(self, w: Watched, taken: SampleTaken, now: float) -> list[Decision]:
        """A stack sample of ``w`` came back (or why none came): it may be sampled again; then what
        it says (``judge_stack``)."""
        sample, native = taken.sample, taken.native
        self._looked.inc()
        self.watched.change(w, sampling=False)
        if taken.deferred is not None:  # its user's py-spy budget was spent: nothing was read, nothing to judge
            self.watched.change(w, sample_at=taken.deferred)
            return []
        if not sample.error:
            if w.sampled_at is not None and w.watched_by_stack:
                self._gap.observe(now - w.sampled_at)
            self.watched.change(w, sampled_at=now)
        if sample.refused:
            self.watched.change(w, check_at=0.0)  # looked at now: its files and owner are checked, and it is dropped
        kind = "native" if native else "plain"
        self.metrics.stack_samples.labels(**self.metrics.labels(kind=kind, outcome="failed" if sample.error else "ok")).inc()
        if not sample.error and not sample.read:
            self.metrics.stack_carried.labels(**self.metrics.labels(kind=kind, why="probe" if sample.probed else "still")).inc()
        if sample.error:
            log.warning("stack_sample_failed", pid=w.process.pid, error=sample.error)
        try:
            self.judge_stack(w, sample, native, now)
        except BaseException:
            self._out = []
            raise
        return self._decided()

    def judge_stack(self, w: Watched, sample: Sample, native: bool, now: float) -> None:
        """A stack sample came back: confirm or drop a suspicion, or start one, and say when to sample next.

        Only plain samples enter the history and the progress mark; the one native look
        at a frozen stack only classifies it (like is compared with like)."""
        every = now + self.cfg.stack_interval
        if sample.error:
            self.watched.change(w, sample_at=every if w.watched_by_stack else float("inf"))
            return
        suspect = w.state is State.SUSPECT and w.suspicion is not None
        if native:
            if w.suspicion is not None and suspect and w.suspicion.reason == "stack":
                self._judge_native(w, sample, now)
            else:  # the state moved on while it was taken: it says nothing now
                self.watched.change(w, sample_at=every if w.watched_by_stack else float("inf"))
            return
        if w.state in (State.HUNG, State.CAPTURED):
            if w.mark is not None:
                self.watched.change(w, mark=rearm.with_sample(w.mark, sample))
            self.watched.change(w, sample_at=every if w.watched_by_stack else float("inf"))
            if w.state is State.CAPTURED:
                self._rearm_if_progressed(w, now)
            return
        self.watched.change(w, history=w.history.added(sample))
        if w.suspicion is not None and suspect and w.suspicion.reason == "heartbeat":
            if w.history.count <= 1 and now < w.confirm_by or self._running_alike(w):
                self.watched.change(w, sample_at=now + 1.0)  # confirming: sample fast
            elif w.history.frozen_for() >= 2.0 or now >= w.confirm_by:
                self._confirm(w, now)
            else:
                self.watched.change(w, sample_at=now + 1.0)
            return
        if suspect:
            return  # a stack suspicion waits for its native look
        if not w.watched_by_stack:
            self.watched.change(w, sample_at=float("inf"))
            return
        window = w.stack_timeout or self.cfg.stack_window
        if w.history.count == 1 and w.idle_noted:
            self.watched.change(w, idle_noted=False)
        if w.history.frozen_for() >= window and not w.idle_noted and self._worked(w, now):
            return
        if w.history.frozen_for() >= window and not w.idle_noted and w.stack_timeout is None \
                and classify(sample.frames, self.blocking, self.idle)[1]:
            # Its Python frames wait where servers wait for work: the native look would add frames
            # but could only find it idle too (an idle pattern wins), so none is taken.
            log.info("stack_frozen_idle", pid=w.process.pid, why="idle pattern")
            self.watched.change(w, idle_noted=True, sample_at=every)
            return
        if w.history.frozen_for() >= window and not w.idle_noted:
            held = w.history.frozen_for()
            log.info("process_suspect", pid=w.process.pid, reason="stack", detail=w.history.evidence())
            self.watched.change(w, State.SUSPECT, why="stack",
                                suspicion=Suspicion("stack", f"the same stack for {held:.0f} s", time.time() - held, ("stack",)),
                                confirm_by=now + self.cfg.pyspy_timeout + 5, sample_at=now)  # now: the native look
        else:
            # Sampled again after an interval, or when the run reaches its window if sooner: a run
            # known to have held since the process stopped (``Sample.since``) is judged on time.
            frozen_from = w.history.frozen_from()
            due = frozen_from + window if frozen_from is not None and not w.idle_noted else every
            self.watched.change(w, sample_at=min(every, max(now + MIN_GAP, due)))

    def _beat_while_still(self, w: Watched, now: float) -> str | None:
        """Why a still stack of a process of one Python thread is not hung: it beat since its stack
        began to hold, so the beat came from that thread and its loop turns (a server that beats
        between polls, a loop that beats between long waits). None with more threads: a beat proves
        only that some thread turns (a side thread that beats while the main thread is stuck)."""
        since = w.history.frozen_from()
        if since is None or w.registration.beat_at is None:
            return None
        try:
            obs = self.detector.observe(w, now)  # its beats read now (the last look may be a timeout old), for the mark too
        except untrusted.Refused:
            return None  # its next look drops it
        if obs.learned:
            self.watched.change(w, **obs.learned)
        if w.last_progress is None or w.last_progress <= since or any(len(s.signature) != 1 for s in w.history.samples):
            return None
        return f"working: its one thread beat {now - w.last_progress:.1f} s ago while its stack held still: its loop turns"

    @staticmethod
    def _running_alike(w: Watched) -> bool:
        """Its still stack's samples all saw a Python thread on the CPU with the same locals, but fewer
        than ``RUNNING_SAMPLES`` of them: a spin, or a loop whose counter py-spy read torn alike."""
        s = w.history.samples
        return 2 <= w.history.count < RUNNING_SAMPLES and all(x.python_running for x in s) and not w.history.locals_moved()

    def _worked(self, w: Watched, now: float) -> bool:
        """A still stack whose plain samples already show work (its one thread beat, bytes moved,
        children computed, locals rebound): healthy again for another window, without the native
        look that would say the same."""
        why = self._beat_while_still(w, now) or self._working(w, None, False)
        if why is None or not why.startswith("working"):
            return False
        log.info("stack_frozen_working", pid=w.process.pid, why=why)
        self.watched.change(w, history=StackHistory(), idle_noted=False, sample_at=now + self.cfg.stack_interval)
        return True

    def _judge_native(self, w: Watched, sample: Sample, now: float) -> None:
        """The one native look at a frozen stack: does it work or wait for work (then it is healthy,
        declared stack timeout or not), is it blocked on something (or declared), or idle?"""
        assert w.suspicion is not None
        blocked, idle = classify(sample.frames, self.blocking, self.idle)
        fine = self._working(w, sample, idle)
        if fine is not None:
            # A still stack that works, or waits for work it does not have: judged again after another window.
            log.info("stack_frozen_working", pid=w.process.pid, why=fine)
            self.watched.change(w, State.HEALTHY, why=fine, suspicion=None, history=StackHistory(), idle_noted=False,
                                sample_at=now + self.cfg.stack_interval)
            return
        declared = w.stack_timeout is not None
        if declared or (blocked and not idle):
            why = "declared --stack-timeout" if declared and not blocked else f"blocked in {blocked}"
            waiting = working.work_waiting(sample.io)
            suspicion = Suspicion("stack", f"the same stack for {w.history.frozen_for():.0f} s ({why})"
                                  + (f"; {waiting}" if waiting else ""), w.suspicion.since, ("stack",))
            self.watched.change(w, suspicion=suspicion)
            self._confirm(w, now)
            return
        if not w.idle_noted:
            log.info("stack_frozen_idle", pid=w.process.pid, why="idle pattern" if idle else "no blocking call")
        self.watched.change(w, State.HEALTHY, why="idle", suspicion=None, idle_noted=True, sample_at=now + self.cfg.stack_interval)

    @staticmethod
    def _working(w: Watched, native: Sample | None, idle: bool) -> str | None:
        """Why a process whose stack held still over its window is not hung: it worked (bytes moved,
        its children or its non-Python threads computed, its local variables changed), or it is a
        server waiting for work that has none. None: its stillness stands."""
        samples = w.history.samples
        first = samples[0].activity if samples else None
        last = (native.activity if native is not None and native.activity is not None
                else samples[-1].activity if samples else None)
        why = working.progress(first, last, any(s.python_running for s in samples))
        if why:
            return f"working: {why}"
        if w.history.locals_moved():
            return "working: its local variables changed while its stack held still"
        quiet = working.idle_server(native.io if native is not None else None, idle)
        return f"idle: {quiet}" if quiet else None

    # -- hangs ---------------------------------------------------------------

    def _hung(self, w: Watched, suspicion: Suspicion, now: float) -> None:
        """Declare ``w`` hung: every rank of its job here goes with it, into one capture."""
        self.metrics.hangs.labels(**self.metrics.labels(reason=suspicion.reason)).inc()
        log.warning("process_hung", pid=w.process.pid, job=w.registration.job, rank=w.registration.rank,
                    reason=suspicion.reason, detail=suspicion.detail, signals=list(suspicion.signals))
        # Every rank of the same job on this node goes into the same incident: the rank
        # that differs is the answer, and it may be one that looks healthy.
        self._out.append(Declare((w, *job_mates(w, self.watched.values())), suspicion, Deadline.after(self.capture_budget, now)))

    def declare(self, group: list[Watched], suspicion: Suspicion, now: float, job_incident: str | None = None,
                requested: str | None = None) -> list[Decision]:
        """Another node's request for this node's ranks of a job: capture ``group`` now, whatever they look like here."""
        return [Declare(tuple(group), suspicion, Deadline.after(self.capture_budget, now), job_incident, requested)]

    def handed_over(self, d: Declare, refused: str | None, now: float) -> None:
        """The loop queued ``d``'s capture (``refused`` None), or could not (why). A first declaration
        makes the group HUNG either way, with a retry due when nothing was queued: never HUNG with
        nothing coming. A retry that could not be queued waits longer."""
        if refused is not None:
            log.warning("capture_not_queued", pids=[x.process.pid for x in d.group], retry=d.retry, error=refused)
        if d.retry:
            for x in d.group:
                if refused is not None:
                    self.capture_failed(x, now)
                else:
                    self.watched.change(x, retry_at=None, check_at=now + min(x.timeout, HUNG_LOOK))
            return
        retry_at = now + retry_pause(1) if refused is not None else None
        for x in d.group:
            self.watched.change(x, State.HUNG, why=d.suspicion.reason, suspicion=d.suspicion, mark=rearm.mark(x),
                                retry_at=retry_at, attempts=1 if retry_at else 0,
                                check_at=retry_at if retry_at is not None else now + min(x.timeout, HUNG_LOOK))

    def stored(self, w: Watched, incident: str) -> None:
        """Its incident is stored: captured, watched for progress from here."""
        if w.state is State.HUNG:
            self.watched.change(w, State.CAPTURED, why="incident stored", suspicion=None, incident=incident,
                                retry_at=None, attempts=0)

    def capture_failed(self, w: Watched, now: float) -> None:
        """No incident came of its capture: it stays HUNG, and is captured again after a pause
        that grows with each failure (bounded), unless it shows progress before."""
        if w.state is not State.HUNG:
            return
        attempts = w.attempts + 1
        pause = retry_pause(attempts)
        log.warning("capture_retry_due", pid=w.process.pid, attempt=attempts, retry_in=pause)
        self.watched.change(w, attempts=attempts, retry_at=now + pause, check_at=now + pause)

    def _retry(self, w: Watched, now: float) -> None:
        """Its capture failed earlier: capture it again, with its job-mates whose capture failed likewise
        (the same owner and job: another user's job of the same name is never one of them)."""
        assert w.suspicion is not None
        group = (w, *[x for x in job_mates(w, self.watched.values(), (State.HUNG,)) if x.retry_at is not None])
        log.warning("capture_retry", pids=[x.process.pid for x in group], attempt=w.attempts + 1)
        self._out.append(Declare(group, w.suspicion, Deadline.after(self.capture_budget, now), retry=True))

    def _rearm_if_progressed(self, w: Watched, now: float) -> bool:
        """A hung or captured process is watched for a new hang only once it shows progress again."""
        if w.mark is None or (w.state is State.HUNG and w.retry_at is None):
            return False  # no mark (a bug); or its capture is under way: that ends first
        why = rearm.progressed(w, w.mark)
        if why is None:
            return False
        log.info("process_recovered", pid=w.process.pid, incident=w.incident, why=why)
        self.watched.change(w, State.HEALTHY, why=why, reset_history=True, check_at=now + 0.1,
                            sample_at=now + self.cfg.stack_interval if w.watched_by_stack else float("inf"))
        return True

    def backoff(self, w: Watched, now: float, what: str) -> None:
        """Its handling raised (logged by the loop's guard): look again after a pause, not at once."""
        if w.process in self.watched:
            if what == "sample":
                self.watched.change(w, sample_at=now + ERROR_BACKOFF)
            else:
                self.watched.change(w, check_at=now + ERROR_BACKOFF)
