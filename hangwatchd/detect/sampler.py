"""Stack samples taken on worker threads, handed back to the loop as values: the frozen-stack detector's eyes.

A py-spy run takes up to ``pyspy_timeout``; the loop never waits for one. Each
user's processes share a sampling budget (``pyspy_samples_per_uid``), so one
user's thousand processes cannot keep py-spy busy for everyone.

Every sample started comes back as one ``SampleTaken`` on the loop's queue,
whatever happened: a py-spy that failed, or a worker that raised (``Popen``
out of descriptors, a bug), comes back as a sample with its ``error``. The
loop alone marks a process as being sampled and clears the mark when its
``SampleTaken`` arrives, so no process stops being sampled for good.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ..host.user_limits import UserLimits
from ..model import ProcessId, Registration
from ..watch.stack_history import Sample
from .stack import take_sample

log = structlog.get_logger("hangwatchd.daemon")

TakeSample = Callable[..., Sample]  # take_sample's signature: (pid, timeout, native, uid, locals=True)


@dataclass(frozen=True)
class SampleTaken:
    """One stack sample of ``process``, or why there is none (``sample.error``)."""

    process: ProcessId
    native: bool  # the one native look at a frozen stack (not a plain sample)
    sample: Sample


@dataclass(frozen=True)
class PaceSampled:
    """One low-rate sample of a rank for its job's pace (what its main thread does), or why there is none."""

    process: ProcessId
    sample: Sample


class Sampler:
    def __init__(self, pyspy_timeout: float, samples_per_uid: float, limits: UserLimits,
                 post: Callable[[object], None], take: TakeSample = take_sample) -> None:
        self.pyspy_timeout = pyspy_timeout
        self.samples_per_uid = samples_per_uid
        self.limits = limits
        self.post = post  # the loop's queue
        self.take = take
        # At most one sample per process is in flight (the loop's Watched.sampling), so the pool's
        # queue is bounded by the watchlist's size.
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="sample")

    def start(self, reg: Registration, native: bool, now: float) -> float | None:
        """Start one sample of ``reg``'s process (native: the one look at a frozen stack); None when
        started (a ``SampleTaken`` follows, always), or, when its user's budget is spent, when to try again."""
        wait = self.limits.sample_wait(reg.uid, now)
        if wait:
            if self.limits.first("pyspy_rate", reg.uid):
                log.warning("stack_sampling_limited", uid=reg.uid, limit=f"pyspy_samples_per_uid = {self.samples_per_uid:g}")
            return now + wait
        self.pool.submit(self._take, reg.process, reg.uid, native)
        return None

    def pace(self, reg: Registration, now: float) -> float | None:
        """Start one pace sample of ``reg``'s process (plain, no local variables: only what its main
        thread does); None when started (a ``PaceSampled`` follows, always), else when to try again.
        The same budget per user as the stack samples."""
        wait = self.limits.sample_wait(reg.uid, now)
        if wait:
            return now + wait
        self.pool.submit(self._take_pace, reg.process, reg.uid)
        return None

    def _take_pace(self, process: ProcessId, uid: int) -> None:
        sample = Sample(time.monotonic(), (), (), None, None, "the sampler stopped before it finished")
        try:
            sample = self.take(process.pid, self.pyspy_timeout, False, uid, False)
        except Exception as exc:  # whatever it was, the loop hears of it as this sample's error
            log.exception("stack_sample_raised", pid=process.pid, error=f"{type(exc).__name__}: {exc}")
            sample = Sample(time.monotonic(), (), (), None, None, f"the sampler raised {type(exc).__name__}: {exc}")
        finally:
            self.post(PaceSampled(process, sample))

    def _take(self, process: ProcessId, uid: int, native: bool) -> None:
        """On a worker: the sample, or the exception that stopped it, as a value on the loop's queue."""
        sample = Sample(time.monotonic(), (), (), None, None, "the sampler stopped before it finished")
        try:
            sample = self.take(process.pid, self.pyspy_timeout, native, uid)
        except Exception as exc:  # whatever it was, the loop hears of it as this sample's error
            log.exception("stack_sample_raised", pid=process.pid, error=f"{type(exc).__name__}: {exc}")
            sample = Sample(time.monotonic(), (), (), None, None, f"the sampler raised {type(exc).__name__}: {exc}")
        finally:
            self.post(SampleTaken(process, native, sample))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
