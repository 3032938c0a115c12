"""Stack samples taken on worker threads, handed back to the loop: the frozen-stack detector's eyes.

A py-spy run takes up to ``pyspy_timeout``; the loop never waits for one. Each
user's processes share a sampling budget (``pyspy_samples_per_uid``), so one
user's thousand processes cannot keep py-spy busy for everyone.
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Callable, Iterator

import structlog

from ..host import procfs
from ..host.user_limits import UserLimits
from ..metrics import Metrics
from ..model import ProcessId, State
from ..watch.stack_history import Sample
from ..watch.watched import Watched, Watchlist
from .stack import take_sample

log = structlog.get_logger("hangwatchd.daemon")


class Sampler:
    def __init__(self, pyspy_timeout: float, samples_per_uid: float, limits: UserLimits, wake: Callable[[], None],
                 metrics: Metrics) -> None:
        self.metrics = metrics
        self.pyspy_timeout = pyspy_timeout
        self.samples_per_uid = samples_per_uid
        self.limits = limits
        self.wake = wake  # a sample is ready: wake the loop
        # At most one sample per process is in flight (Watched.sampling), so the pool's queue is
        # bounded by the watchlist's size.
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="sample")
        self.done: queue.SimpleQueue[tuple[ProcessId, Sample, bool]] = queue.SimpleQueue()

    def sample(self, w: Watched, now: float) -> float | None:
        """Start one sample of ``w`` (native when it is the one look at a frozen stack); or, when its
        user's budget is spent, say when to try again (the caller schedules it)."""
        wait = self.limits.sample_wait(w.registration.uid, now)
        if wait:
            if self.limits.first("pyspy_rate", w.registration.uid):
                log.warning("stack_sampling_limited", uid=w.registration.uid,
                            limit=f"pyspy_samples_per_uid = {self.samples_per_uid:g}")
            return now + wait
        w.sampling = True
        pid = w.process
        native = w.state is State.SUSPECT and w.suspicion is not None and w.suspicion.reason == "stack"
        future = self.pool.submit(take_sample, pid.pid, self.pyspy_timeout, native, w.registration.uid)

        def done(f: concurrent.futures.Future[Sample]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.done.put((pid, f.result(), native))
            self.wake()

        future.add_done_callback(done)
        return None

    def ready(self, watched: Watchlist) -> Iterator[tuple[Watched, Sample, bool]]:
        """The samples taken since last asked, of processes still watched and alive: (process,
        sample, whether it was the native look). What they mean is the state machine's to say."""
        while True:
            try:
                pid, sample, native = self.done.get_nowait()
            except queue.Empty:
                return
            w = watched.get(pid)
            if w is None:
                continue
            w.sampling = False
            if not procfs.alive(pid):
                continue
            if sample.refused:
                watched.change(w, check_at=0.0)  # looked at now: its files and owner are checked, and it is dropped
            self.metrics.stack_samples.labels(**self.metrics.labels(kind="native" if native else "plain",
                                                                    outcome="failed" if sample.error else "ok")).inc()
            if sample.error:
                log.warning("stack_sample_failed", pid=pid.pid, error=sample.error)
            yield w, sample, native

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
