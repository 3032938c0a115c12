"""The loop's room for jobs' pace: looks, samples, NVML over the window, episodes filed and ended.

Everything here runs on the loop thread and owns the ``Paces`` (watch/pace.py).
The slow work goes to workers that post frozen values back: a pace sample to
the sampler's pool (``PaceSampled``), an NVML look to a thread of its own
(``GpusLooked``: the probe, a child with a deadline, as the capture's), the
other nodes' records to the fleet's poller (``PacesRead``). What the machine
decides (``DeclareSlow``) the loop hands to the capture workers.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ..analyze import slow
from ..capture.nvml import NOT_HERE, PROBE
from ..config import Config
from ..detect.pace import MIN_SAMPLES
from ..detect.pace_machine import DeclareSlow, PaceMachine
from ..detect.sampler import PaceSampled, Sampler
from ..fleet.agent import Agent
from ..fleet.paces import PacesRead
from ..host import subproc
from ..metrics import Metrics
from ..model import JobPace, RankPace
from ..watch.pace import SLOW, STEADY, JobKey, Pace, Paces
from ..watch.watched import Watchlist

log = structlog.get_logger("hangwatchd.daemon")

NVML_ABSENT_FOR = 600.0  # seconds NVML is not asked again once the probe said it is not here


@dataclass(frozen=True)
class GpusLooked:
    """One NVML look at the node's GPUs for a job that is slower (the probe's JSON), or why there is none."""

    key: JobKey
    time: float  # monotonic
    data: dict[str, Any] | None
    error: str | None = None
    absent: bool = False  # NVML is not here (no library, driver or GPU)


class PaceRoom:
    def __init__(self, cfg: Config, watched: Watchlist, metrics: Metrics, sampler: Sampler,
                 post: Callable[[object], None], fleet: Agent | None) -> None:
        self.cfg = cfg
        self.watched = watched
        self.metrics = metrics
        self.sampler = sampler
        self.post = post
        self.fleet = fleet
        self.paces = Paces(metrics)
        self.machine = PaceMachine(cfg, self.paces, cfg.node, expects_remote=fleet is not None)
        self.next_tick = 0.0
        self.next_publish = 0.0
        self.nvml_absent_until = 0.0
        self.gpu_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pace-nvml")

    def next_due(self) -> float:
        due = [self.next_tick]
        for p in self.paces.values():
            if not p.paused:
                due.append(p.next_sample)
            if p.state != STEADY and not p.looking_at_gpus and self._nvml_here():
                due.append(p.next_gpu_look)
        return min(due)

    def shutdown(self) -> None:
        self.gpu_pool.shutdown(wait=True, cancel_futures=True)

    # -- each turn of the loop ---------------------------------------------------------

    def run(self, now: float) -> list[DeclareSlow]:
        decided: list[DeclareSlow] = []
        if now >= self.next_tick:
            self.next_tick = now + self.machine.every
            before = {k: (p, p.state) for k, p in self.paces.items()}
            decided = self.machine.tick(self.watched.values(), now)
            for key, (p, _state) in before.items():
                if key not in self.paces:
                    self._forget(p)  # every rank of it gone
            for key, p in self.paces.items():
                old = before[key][1] if key in before else None
                if old != p.state:
                    self._changed(p, old, now)
                self._export(p)
            if now >= self.next_publish:
                self.next_publish = now + self.cfg.slow_publish_interval
                self._publish(now)
        for p in self.paces.values():
            self._sample(p, now)
            if p.state != STEADY and now >= p.next_gpu_look and not p.looking_at_gpus and self._nvml_here():
                self._look_at_gpus(p, now)
        return decided

    def _sample(self, p: Pace, now: float) -> None:
        reg = self.machine.due(p, now)
        if reg is None:
            return
        again = self.sampler.pace(reg, now)
        if again is None:
            p.sampling.add(reg.process)  # until its PaceSampled comes back, which it always does
        else:
            p.next_sample = again

    def sampled(self, taken: PaceSampled) -> None:
        for p in self.paces.values():
            if taken.process in p.ranks or taken.process in p.sampling:
                self.machine.sampled(p, taken)
                return

    # -- NVML over the window -----------------------------------------------------------

    def _nvml_here(self) -> bool:
        return "nvml" in self.cfg.capture_steps and time.monotonic() >= self.nvml_absent_until

    def _look_at_gpus(self, p: Pace, now: float) -> None:
        p.looking_at_gpus = True
        p.next_gpu_look = now + self.cfg.slow_sample_interval
        self.gpu_pool.submit(self._probe, p.key)

    def _probe(self, key: JobKey) -> None:
        """On the NVML thread: one look at every GPU of the node, as a value on the loop's queue."""
        looked = GpusLooked(key, time.monotonic(), None, "the NVML thread stopped before it finished")
        try:
            res = subproc.run([sys.executable, "-P", str(PROBE), "0"], timeout=self.cfg.nvml_timeout)
            if res.returncode == NOT_HERE:
                looked = GpusLooked(key, time.monotonic(), None, res.stderr_line(), absent=True)
            elif not res.ok:
                looked = GpusLooked(key, time.monotonic(), None, res.stderr_line() or f"the NVML probe failed ({res.returncode})")
            else:
                data = json.loads(res.stdout)
                looked = GpusLooked(key, time.monotonic(), data if isinstance(data, dict) else None)
        except Exception as exc:  # noqa: BLE001 - the loop hears of it as this look's error
            looked = GpusLooked(key, time.monotonic(), None, f"{type(exc).__name__}: {exc}")
        finally:
            self.post(looked)

    def gpus_looked(self, looked: GpusLooked) -> None:
        p = self.paces.get(looked.key)
        if looked.absent:
            self.nvml_absent_until = time.monotonic() + NVML_ABSENT_FOR
        if p is None:
            return
        p.looking_at_gpus = False
        if looked.data is None:
            if not looked.absent:
                log.warning("pace_nvml_failed", job=p.job, error=looked.error)
            return
        if p.state != STEADY:
            p.gpus.append((looked.time, looked.data))
        for s in p.ranks.values():  # which GPU each rank runs on, as NVML lists its processes
            for dev in looked.data.get("devices") or []:
                if isinstance(dev, dict) and any(isinstance(x, dict) and x.get("pid") == s.registration.process.pid
                                                 for x in dev.get("processes") or []):
                    s.gpu = dev.get("index") if isinstance(dev.get("index"), int) else None

    # -- across nodes ---------------------------------------------------------------------

    def paces_read(self, read: PacesRead) -> None:
        p = self.paces.get(read.key)
        if p is not None:
            p.remote = {r.node: r for r in read.records}

    def _publish(self, now: float) -> None:
        """This node's records to the fleet's poller (published at its own pace), the jobs whose other
        nodes' records it should read back; and the slowest rank's wait share on /metrics."""
        wall = time.time()
        records: dict[JobKey, JobPace] = {}
        for key, p in self.paces.items():
            record = p.record(self.cfg.node, now, wall, self.cfg.slow_window)
            records[key] = record
            self._export_slowest(p, [*record.ranks, *(r for rec in self.machine.fresh_remote(p, wall) for r in rec.ranks)])
        if self.fleet is not None:
            self.fleet.paces = records
            self.fleet.pace_reads = frozenset(k for k, p in self.paces.items() if p.state != STEADY)

    # -- episodes ----------------------------------------------------------------------

    def handed_over(self, d: DeclareSlow, refused: str | None) -> None:
        if refused is not None:
            log.warning("slow_capture_not_queued", job=d.key[1], uid=d.key[0], error=refused,
                        note="the episode is filed once; its figures stay on /metrics")

    def filed(self, key: JobKey, incident: str | None) -> None:
        p = self.paces.get(key)
        if p is not None and p.state == SLOW and incident is not None:
            p.incident = incident

    def _changed(self, p: Pace, old: str | None, now: float) -> None:
        if p.state == SLOW:
            self.metrics.slow_episodes.labels(**self.metrics.const).inc()
            wall = time.time()
            record = p.finding or p.record(self.cfg.node, now, wall, self.cfg.slow_window)
            verdict = slow.judge([record, *self.machine.fresh_remote(p, wall)])
            figures = verdict.pace or {}
            labels = (str(figures.get("rank", "")), str(figures.get("node", "")), str(figures.get("cause", "")))
            self._drop_slow(p)
            self.metrics.job_slow.labels(*self.metrics.const.values(), p.job, *labels).set(1)
            p.series = {**(p.series or {}), "slow": labels}
        elif old == SLOW:
            self._drop_slow(p)

    def _drop_slow(self, p: Pace) -> None:
        labels = (p.series or {}).pop("slow", None)
        if labels is not None:
            try:
                self.metrics.job_slow.remove(*self.metrics.const.values(), p.job, *labels)
            except KeyError:
                pass

    # -- /metrics -------------------------------------------------------------------------

    def _export(self, p: Pace) -> None:
        const = list(self.metrics.const.values())
        if p.steps:
            self.metrics.job_step.labels(*const, p.job).set(p.steps[-1][1])
        if p.baseline is not None:
            self.metrics.job_baseline.labels(*const, p.job).set(p.baseline)

    def _export_slowest(self, p: Pace, ranks: list[RankPace]) -> None:
        read = [r for r in ranks if r.samples >= MIN_SAMPLES]
        old = (p.series or {}).get("slowest")
        if not read:
            return
        r = min(read, key=lambda x: x.collective / x.samples)
        labels = (str(r.rank if r.rank is not None else ""), r.node)
        if old is not None and old != labels:
            try:
                self.metrics.job_slowest_wait.remove(*self.metrics.const.values(), p.job, *old)
            except KeyError:
                pass
        self.metrics.job_slowest_wait.labels(*self.metrics.const.values(), p.job, *labels).set(round(r.collective / r.samples, 4))
        p.series = {**(p.series or {}), "slowest": labels}

    def _forget(self, p: Pace) -> None:
        """A job no longer watched: its step, baseline, slowest rank and episode leave /metrics."""
        const = list(self.metrics.const.values())
        self._drop_slow(p)
        for g in (self.metrics.job_step, self.metrics.job_baseline):
            try:
                g.remove(*const, p.job)
            except KeyError:
                pass
        slowest = (p.series or {}).get("slowest")
        if slowest is not None:
            try:
                self.metrics.job_slowest_wait.remove(*const, p.job, *slowest)
            except KeyError:
                pass
