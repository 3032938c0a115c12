"""The state machine of one watched process: healthy -> suspect -> hung, and back.

One signal makes a process suspect (a beat that does not come, a stack that
does not move); a second look confirms or drops the suspicion before anything
destructive happens. A beat that pauses under a learned timeout needs a still
stack too; a frozen stack counts only when it is blocked on something that
should come (the GPU, a collective, a lock), not idle waiting for work, unless
the user declared ``--stack-timeout``. On a confirmed hang every rank of the
same job here is declared hung with it, and the group is handed to
``on_hung``: the daemon captures it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog

from ..config import Config
from ..host import untrusted
from ..metrics import Metrics
from ..model import ProcessId, State, Suspicion
from ..watch.stack_history import Sample
from ..watch.watched import Watched, Watchlist
from . import rearm
from .base import Detector
from .stack import classify

log = structlog.get_logger("hangwatchd.daemon")

ERROR_BACKOFF = 5.0  # a process whose handling failed is looked at again after this, not at once


class StateMachine:
    def __init__(self, cfg: Config, detector: Detector, watched: Watchlist, metrics: Metrics,
                 blocking: Sequence[str], idle: str,
                 on_hung: Callable[[list[Watched], Suspicion], None],
                 on_tampered: Callable[[Watched, untrusted.Refused], None]) -> None:
        self.cfg = cfg
        self.detector = detector
        self.watched = watched
        self.metrics = metrics
        self.blocking = blocking
        self.idle = idle
        self.on_hung = on_hung  # a confirmed hang: the process and its job-mates here, to capture
        self.on_tampered = on_tampered  # its files were swapped: the registration is dropped
        self.marks: dict[ProcessId, rearm.ProgressMark] = {}  # where each captured process stood

    def observe(self, w: Watched, now: float) -> None:
        """Its detector's look, due now: move its state on, or note when to look again."""
        try:
            w.check_files()
            obs = self.detector.observe(w, now)
        except untrusted.Refused as exc:
            self.on_tampered(w, exc)
            return
        w.next_check = obs.next_check
        r = w.registration
        labels = self.metrics.labels(job=r.job or "", rank=str(r.rank if r.rank is not None else ""), pid=str(r.process.pid))
        self.metrics.timeout.labels(**labels).set(w.timeout)
        if w.beat is not None and w.beat.count:
            self.metrics.last_beat.labels(**labels).set(w.beat.wall_time() or 0)
        if w.state in (State.HUNG, State.CAPTURED):
            if w.state is State.CAPTURED and self._rearm_if_progressed(w):
                pass
            else:
                w.next_check = now + min(w.timeout, 5.0)  # look again later in case it recovers
            return
        if obs.state is State.SUSPECT:
            if w.state is not State.SUSPECT:
                self._suspect(w, obs.suspicion, now)
            elif now >= w.confirm_by:
                self._confirm(w, now)
            w.next_check = max(now + 0.1, min(w.confirm_by, now + 1.0))
            return
        if w.state is State.SUSPECT and w.suspicion and w.suspicion.reason == "heartbeat":
            log.info("suspicion_dropped", pid=r.process.pid, why="a beat came")
            w.suspicion = None
        if obs.state is not w.state and not (w.state is State.SUSPECT and w.suspicion):
            self.watched.set_state(w, obs.state)

    def _suspect(self, w: Watched, suspicion: Suspicion | None, now: float) -> None:
        """One signal says stalled. Confirm before anything is done about it."""
        assert suspicion is not None
        w.suspicion = suspicion
        self.watched.set_state(w, State.SUSPECT)
        log.info("process_suspect", pid=w.process.pid, reason=suspicion.reason, detail=suspicion.detail)
        if suspicion.reason == "heartbeat" and w.timeout_source == "learned":
            # A learned timeout may only mean a new phase: the stack must hold still too.
            w.history = type(w.history)()
            w.confirm_by = now + max(3.0, min(10.0, w.timeout / 2))
            w.next_sample = now
        else:
            w.confirm_by = now + 0.5  # a declared timeout: one more look, then act

    def _confirm(self, w: Watched, now: float) -> None:
        suspicion = w.suspicion
        assert suspicion is not None
        signals = set(suspicion.signals)
        if w.history.frozen_for() >= 2.0:
            signals.add("stack")
        why_not = None
        if suspicion.reason == "heartbeat" and w.timeout_source == "learned":
            busy = w.history.cpu_share() if w.history.samples else None
            blocked, _ = classify(w.history.samples[-1].frames if w.history.samples else (), self.blocking, self.idle)
            if "stack" not in signals:
                why_not = "the stack moved"
            elif busy is not None and busy >= 0.5 and not blocked:
                why_not = "busy on the CPU, blocked on nothing"
        if why_not:
            # The beats paused but the process works: a new phase, not a hang. Learn the longer gap.
            log.info("suspicion_dropped", pid=w.process.pid, why=why_not, paused=round(now - (w.last_progress or now), 1))
            w.intervals.append(now - (w.last_progress or now))
            w.last_progress = now
            w.suspicion = None
            w.next_sample = float("inf") if not w.watched_by_stack else now + self.cfg.stack_interval
            self.watched.set_state(w, State.HEALTHY)
            return
        if w.beat is not None and w.last_progress is not None and suspicion.reason == "stack":
            if now - w.last_progress > w.timeout:
                signals.add("heartbeat")
        evidence = f"; {w.history.evidence()}" if w.history.samples and "stack" in signals else ""
        self._hung(w, Suspicion(suspicion.reason, suspicion.detail + evidence, suspicion.since, tuple(sorted(signals))))

    def judge_stack(self, w: Watched, sample: Sample, native: bool, now: float) -> None:
        """A stack sample came back: confirm or drop a suspicion, or start one, and say when to sample next."""
        suspect = w.state is State.SUSPECT and w.suspicion is not None
        if suspect and w.suspicion.reason == "heartbeat":  # type: ignore[union-attr]
            if len(w.history.samples) <= 1 and now < w.confirm_by:
                w.next_sample = now + 1.0  # confirming: sample fast
            elif w.history.frozen_for() >= 2.0 or now >= w.confirm_by:
                self._confirm(w, now)
            else:
                w.next_sample = now + 1.0
            return
        if suspect and native:  # the one native look at a frozen stack: does it count?
            blocked, idle = classify(sample.frames, self.blocking, self.idle)
            declared = w.stack_timeout is not None
            if declared or (blocked and not idle):
                why = "declared --stack-timeout" if declared and not blocked else f"blocked in {blocked}"
                w.suspicion = Suspicion("stack", f"the same stack for {w.history.frozen_for():.0f} s ({why})",
                                        w.suspicion.since, ("stack",))  # type: ignore[union-attr]
                self._confirm(w, now)
            else:
                if not w.idle_noted:
                    log.info("stack_frozen_idle", pid=w.process.pid, why="idle pattern" if idle else "no blocking call")
                    w.idle_noted = True
                w.suspicion = None
                self.watched.set_state(w, State.HEALTHY)
                w.next_sample = now + self.cfg.stack_interval
            return
        if not w.watched_by_stack or w.state in (State.HUNG, State.CAPTURED):
            w.next_sample = float("inf") if not w.watched_by_stack else now + self.cfg.stack_interval
            if w.process in self.marks:
                self.marks[w.process] = rearm.with_sample(self.marks[w.process], sample)
            if w.state is State.CAPTURED:
                self._rearm_if_progressed(w)
            return
        window = w.stack_timeout or self.cfg.stack_window
        if len(w.history.samples) == 1:
            w.idle_noted = False
        if w.history.frozen_for() >= window and not w.idle_noted:
            w.suspicion = Suspicion("stack", f"the same stack for {w.history.frozen_for():.0f} s", time.time() - w.history.frozen_for(), ("stack",))
            self.watched.set_state(w, State.SUSPECT)
            log.info("process_suspect", pid=w.process.pid, reason="stack", detail=w.history.evidence())
            w.confirm_by = now + self.cfg.pyspy_timeout + 5
            w.next_sample = now  # the native look
        else:
            w.next_sample = now + self.cfg.stack_interval

    def captured(self, group: list[Watched]) -> None:
        """A capture of ``group`` starts: mark where each stood, to tell progress from a hang later."""
        for x in group:
            self.marks[x.process] = rearm.mark(x)

    def capture_failed(self, w: Watched, now: float) -> None:
        """No incident to show for it: watch it as before, so the hang is captured again
        (after a pause, so a capture that always fails does not spin)."""
        self.marks.pop(w.process, None)
        self.watched.set_state(w, State.HEALTHY)
        w.next_check = now + ERROR_BACKOFF

    def _rearm_if_progressed(self, w: Watched) -> bool:
        """A captured process is watched for a new hang only once it shows progress again."""
        m = self.marks.get(w.process)
        why = rearm.progressed(w, m) if m is not None else "no mark"
        if why is None:
            return False
        self.marks.pop(w.process, None)
        log.info("process_recovered", pid=w.process.pid, incident=w.incident, why=why)
        w.history = type(w.history)()
        self.watched.set_state(w, State.HEALTHY)
        return True

    def _hung(self, w: Watched, suspicion: Suspicion | None) -> None:
        assert suspicion is not None
        self.watched.set_state(w, State.HUNG)
        self.metrics.hangs.labels(**self.metrics.labels(reason=suspicion.reason)).inc()
        log.warning("process_hung", pid=w.process.pid, job=w.registration.job, rank=w.registration.rank,
                    reason=suspicion.reason, detail=suspicion.detail, signals=list(suspicion.signals))
        w.suspicion = None
        # Every rank of the same job on this node goes into the same incident: the rank
        # that differs is the answer, and it may be one that looks healthy. A job is
        # (owner uid, name): another user's process under the same name is not a rank of it.
        mates = [x for x in self.watched.values() if x is not w and w.registration.job
                 and x.registration.job == w.registration.job and x.registration.uid == w.registration.uid
                 and x.role != "launcher"
                 and x.state in (State.STARTING, State.HEALTHY, State.SUSPECT)]
        for x in mates:
            x.suspicion = None
            self.watched.set_state(x, State.HUNG)
        self.on_hung([w] + mates, suspicion)
