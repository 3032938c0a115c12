"""Slow is a hang in the making: a job's pace against its own baseline, one episode at a time.

At each look (``tick``, every few seconds) every live rank of each job that
beats has its beat segment and its counters read; the job's step time is the
median of its ranks' (in a synchronous job they are one). Its baseline is
learned from its steady steps, as a timeout is learned from beats. A job over
its baseline by ``slow_margin`` is slower; slower for ``slow_for`` it is slow,
once the rank that holds it back is known from the ranks' stack samples (the
one that waits least in collectives, here or, through the store, on another
node): an episode, one incident, filed on the node of that rank (``DeclareSlow``).
A job that waits everywhere here files it here too (the network or another
node holds it back). A job slower alike on every rank, none waiting less, has
entered a new phase: its baseline is learned again. A job back within half its
margin ends its episode.

A job with a rank that is suspect, hung or captured is not judged: a hang is
the heartbeat's and the stack's business, and a slow job that hangs gets its
hang incident as any other. The machine reads beat segments and /proc (neither
blocks) and calls nobody back: it returns what is to be done, and changes a
job's episode only through ``Paces.change``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from ..config import Config
from ..host import activity, untrusted
from ..model import JobPace, Registration, State, Suspicion
from ..watch.pace import SLOW, SLOWER, STEADY, JobKey, Pace, Paces, PaceSample, RankSeries, Tick
from ..watch.watched import Watched
from ..workload import beat_segment
from . import pace
from .sampler import PaceSampled

log = structlog.get_logger("hangwatchd.detect")

BASELINE_MIN = 20  # steady looks before a baseline is taken
STALE_AFTER = 3.0  # another node's record counts for this many of its publishing intervals
SLOWER_RATE = 5  # a job slower than its baseline has its ranks sampled this many times as often


@dataclass(frozen=True)
class DeclareSlow:
    """A slow episode to file on this node: capture ``group`` (stacks and NVML only) with ``records``
    (this node's and the other nodes' records of the job) beside it."""

    key: JobKey
    group: tuple[Watched, ...]
    suspicion: Suspicion
    records: tuple[JobPace, ...]


def tick_every(cfg: Config) -> float:
    """How often a job's ranks are looked at: often enough to see an episode within ``slow_for``."""
    return min(5.0, max(0.5, cfg.slow_for / 10))


class PaceMachine:
    def __init__(self, cfg: Config, paces: Paces, node: str, expects_remote: bool = False) -> None:
        self.cfg = cfg
        self.expects_remote = expects_remote  # a shared store: the other nodes' records name the slowest rank of the job
        self.paces = paces
        self.node = node
        self.every = tick_every(cfg)
        self.recent = max(self.every * 1.5, cfg.slow_for / 3)  # the step time judged: the median of this many seconds

    # -- which ranks make a job ---------------------------------------------------------

    @staticmethod
    def jobs(watched: Iterable[Watched]) -> dict[JobKey, list[Watched]]:
        """Every job that beats, with its ranks (never a launcher, never a process without a job)."""
        out: dict[JobKey, list[Watched]] = {}
        for w in watched:
            r = w.registration
            if r.job is None or w.role == "launcher" or r.beat_at is None or w.state is State.EXITED:
                continue
            out.setdefault((r.uid, r.job), []).append(w)
        return out

    # -- a look at every job -------------------------------------------------------------

    def tick(self, watched: Iterable[Watched], now: float, wall: float | None = None) -> list[DeclareSlow]:
        wall = time.time() if wall is None else wall
        out: list[DeclareSlow] = []
        jobs = self.jobs(watched)
        for key in [k for k in self.paces if k not in jobs]:
            del self.paces[key]  # every rank gone: what it learned goes with it
        for key, ranks in jobs.items():
            p = self.paces.get(key)
            if p is None:
                p = self.paces[key] = Pace(key, next_sample=now)
            d = self._look(p, ranks, now, wall)
            if d is not None:
                out.append(d)
        return out

    def _look(self, p: Pace, ranks: list[Watched], now: float, wall: float) -> DeclareSlow | None:
        p.paused = any(w.state not in (State.STARTING, State.HEALTHY) for w in ranks)
        if p.paused:
            return None  # suspect, hung or captured: a hang's business, not a pace's (nor sampled meanwhile)
        live = {w.process: w for w in ranks}
        for pid in [x for x in p.ranks if x not in live]:
            del p.ranks[pid]
        steps = []
        for w in ranks:
            s = p.ranks.get(w.process)
            if s is None:
                s = p.ranks[w.process] = RankSeries(w.registration)
            t = self._read(w.registration, now)
            if t is None:
                continue
            prev = s.ticks[-1] if s.ticks else None
            s.ticks.append(t)
            if prev is not None:
                step = pace.rank_step((prev.beats, prev.last_ns), (t.beats, t.last_ns))
                if step is not None:
                    steps.append(step)
                    if p.baseline is None:
                        p.beats_seen += t.beats - prev.beats
        step = pace.median(steps)
        if step is None:
            return None  # no rank stepped since the last look: nothing to judge (a hang is not slow)
        p.steps.append((now, step))
        current = pace.median(s for t, s in p.steps if t >= now - self.recent)
        assert current is not None
        return self._judge(p, list(live.values()), step, current, now, wall)

    def _read(self, reg: Registration, now: float) -> Tick | None:
        if reg.beat_at is None:
            return None
        try:
            reading = beat_segment.read(reg.beat_at)
        except (beat_segment.SegmentError, untrusted.Refused):
            return None  # the heartbeat detector says what is wrong with it
        if not reading.count:
            return None
        return Tick(now, reading.count, reading.last_ns, activity.read(reg.process.pid))

    def _judge(self, p: Pace, ranks: list[Watched], step: float, current: float, now: float, wall: float) -> DeclareSlow | None:
        margin = self.cfg.slow_margin
        if p.state == STEADY:
            if p.baseline is None or current <= p.baseline * (1 + margin):
                # The baseline follows the job's steady steps, not those of a job drifting towards its margin.
                if p.baseline is None or step <= p.baseline * (1 + margin / 2):
                    p.steady.append(step)
                if len(p.steady) >= BASELINE_MIN and p.beats_seen >= self.cfg.learn_min_beats or p.baseline is not None:
                    p.baseline = pace.median(p.steady)
                return None
            self.paces.change(p, SLOWER, why=f"{current:.3g} s a step against its baseline of {p.baseline:.3g} s",
                              since=now, since_wall=wall)
            return None
        assert p.baseline is not None
        if p.state == SLOWER:
            if current <= p.baseline * (1 + margin / 2):
                self.paces.change(p, STEADY, why="back within half its margin")
                return None
            if now - (p.since or now) < self.cfg.slow_for:
                return None
            return self._decide(p, ranks, current, now, wall)
        if p.state == SLOW and current <= p.baseline * (1 + margin / 2):
            self._ended(p, current, now, "back to its pace: the episode ended")
        elif p.state == SLOW and now - (p.since or now) >= 3 * self.cfg.slow_for and now >= p.next_review:
            # Still slower, but perhaps no longer for the rank the episode was about: a job whose ranks
            # are alike again over the last slow_for (all of them slower: a new phase, a busier node)
            # has ended its episode, and learns its pace again.
            p.next_review = now + self.cfg.slow_for / 2
            recent = p.record(self.node, now, wall, 2 * self.cfg.slow_for, recent=True)
            if pace.alike([*recent.ranks, *(r for rec in self.fresh_remote(p, wall) for r in rec.ranks)], 2 * pace.MIN_SAMPLES):
                p.steady.clear()
                p.relearned += 1
                self._ended(p, current, now, "no rank holds it back any more: the episode ended, its pace is learned again",
                            baseline=None)
        return None

    def _ended(self, p: Pace, current: float, now: float, why: str, **values: Any) -> None:
        log.warning("job_slow_ended", job=p.job, uid=p.uid, incident=p.incident, step=round(current, 4),
                    baseline=round(p.baseline or 0.0, 4), lasted=round(now - (p.since or now), 1), why=why)
        self.paces.change(p, STEADY, why=why, **values)

    def _decide(self, p: Pace, ranks: list[Watched], current: float, now: float, wall: float) -> DeclareSlow | None:
        """Slower for long enough: whose the episode is, if the samples say yet."""
        mine = p.record(self.node, now, wall, self.cfg.slow_window)
        theirs = self.fresh_remote(p, wall)
        found = pace.slowest([*mine.ranks, *(r for rec in theirs for r in rec.ranks)])
        slower_by = current / (p.baseline or current) - 1
        detail = (f"job {p.job} is {slower_by:.0%} slower than its baseline ({current:.3g} s a step against "
                  f"{p.baseline:.3g} s) for {now - (p.since or now):.0f} s")
        if found is not None and found.rank.node != self.node:
            log.warning("job_slow_elsewhere", job=p.job, uid=p.uid, detail=detail, rank=found.rank.rank,
                        node=found.rank.node, wait_share=round(found.share, 3), others=round(found.others, 3))
            self.paces.change(p, SLOW, why=f"rank {found.rank.rank} on {found.rank.node} holds it back", elsewhere=found.rank.node,
                              named=(found.rank.rank, found.rank.node))
            return None
        patient = now - (p.since or now) < 3 * self.cfg.slow_for
        everyone = [*mine.ranks, *(r for rec in theirs for r in rec.ranks)]
        # Every rank here waits in collectives, none apart and none waiting for a CPU: the network or
        # another node (whose records, with a store, are waited for: they say which).
        elsewhere = found is None and pace.everyone_waits(mine.ranks) and not pace.contended(mine.ranks, current) \
            and pace.alike(mine.ranks, 2 * pace.MIN_SAMPLES) and (theirs or not self.expects_remote or not patient)
        if found is None and not elsewhere:
            if not patient and (pace.alike(everyone) or now - (p.since or now) >= self.cfg.slow_window):
                # Slower alike on every rank, none waiting less, nothing waiting on another node: a new phase.
                log.info("job_pace_relearned", job=p.job, uid=p.uid, detail=detail,
                         why="every rank is slower alike and none waits less than the others: a new phase")
                p.steady.clear()
                p.relearned += 1
                self.paces.change(p, STEADY, why="a new phase: its baseline is learned again", baseline=None)
                return None
            if now >= p.next_review:  # said now and then, so that a person sees why nothing is filed yet
                p.next_review = now + self.cfg.slow_for
                log.info("job_pace_undecided", job=p.job, uid=p.uid, detail=detail,
                         why="no rank waits clearly less than the others yet",
                         wait_shares={f"{r.rank}@{r.node}": f"{r.collective}/{r.samples}" for r in everyone})
            return None  # not sampled enough yet to say who
        named = (found.rank.rank, found.rank.node) if found else None
        record = JobPace(mine.job, mine.uid, mine.node, mine.time, current, mine.baseline_s, SLOW, mine.since,
                         mine.window_s, mine.ranks, mine.gpus, named[0] if named else None, named[1] if named else None)
        why = (f"rank {found.rank.rank} waits in collectives {found.share:.0%} of the time, the others {found.others:.0%}"
               if found else "every rank here waits in collectives")
        log.warning("job_slow", job=p.job, uid=p.uid, detail=detail, why=why)
        self.paces.change(p, SLOW, why=why, finding=record, named=named)
        return DeclareSlow(p.key, tuple(ranks), Suspicion("slow", f"{detail}; {why}", p.since_wall or wall, ("pace",)),
                           (record, *theirs))

    def fresh_remote(self, p: Pace, wall: float) -> list[JobPace]:
        """Other nodes' records of the job, as recent as their publishing lets them be."""
        horizon = STALE_AFTER * self.cfg.slow_publish_interval + 30.0  # give or take two nodes' clocks
        return [r for node, r in sorted(p.remote.items()) if node != self.node and wall - r.time <= horizon]

    # -- samples --------------------------------------------------------------------------

    def due(self, p: Pace, now: float) -> Registration | None:
        """The rank whose turn it is to be sampled, when one is due (the job's ranks take turns, so a
        steady job costs one sample per rank per ``slow_sample_interval``, and one that is slower
        SLOWER_RATE times that, to say who holds it back within ``slow_for``); None when none is."""
        if now < p.next_sample or not p.ranks or p.paused:
            return None
        order = sorted(p.ranks.values(), key=lambda s: s.registration.process.pid)
        every = self.cfg.slow_sample_interval / (SLOWER_RATE if p.state != STEADY else 1)
        p.next_sample = now + every / len(order)
        for i in range(len(order)):
            s = order[(p.turn + i) % len(order)]
            if s.registration.process not in p.sampling:
                p.turn = (p.turn + i + 1) % len(order)
                return s.registration
        return None

    def sampled(self, p: Pace, taken: PaceSampled) -> None:
        p.sampling.discard(taken.process)
        s = p.ranks.get(taken.process)
        sample = taken.sample
        if s is None or sample.error or sample.main is None:
            return
        s.samples.append(PaceSample(sample.time, sample.main, sample.main_at))

    @staticmethod
    def of(paces: Paces, reg: Registration) -> Pace | None:
        for p in paces.values():
            if reg.job == p.job and reg.uid == p.uid:
                return p
        return None

