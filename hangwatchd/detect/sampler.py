"""Stack samples taken on worker threads, handed back to the loop as values: the frozen-stack detector's eyes.

A py-spy run takes up to ``pyspy_timeout``; the loop never waits for one. A sample
reads the process's counters first (``host.activity``: each thread's CPU time, one
``schedstat`` a thread) and runs py-spy only where a thread ran since the stack was
last read: a process that stood still has the same stack, carried forward
(``stack.carried``). On a node of a thousand processes, most waiting, most samples
cost a few reads of /proc instead of a py-spy's start (9 ms of CPU each). The native
look at a frozen stack is carried likewise from the last one (its sockets read anew).
``quiet.Quiet`` follows, every second, when each process's threads last ran, so a
stack read after a freeze is known to have held since then.

A process whose threads ran is read again, but first probed where it has one or two threads
(``stack_probe``: one long-lived helper that reads its Python state without a fork and exec;
its read costs about 4 ms a thread, so past two py-spy costs less): where the probe
reads the same frames and locals as when py-spy last read it, py-spy's sample is carried
forward with the counters read now; else py-spy reads it.

Each user's processes share a budget of reads (``pyspy_samples_per_uid``: a probe and the
py-spy run after it count as one), so one user's thousand processes cannot keep py-spy
busy for everyone; a sample carried where no thread ran spends none of it.

Every sample started comes back as one ``SampleTaken`` on the loop's queue,
whatever happened: a py-spy that failed, or a worker that raised (``Popen``
out of descriptors, a bug), comes back as a sample with its ``error``. The
loop alone marks a process as being sampled and clears the mark when its
``SampleTaken`` arrives, so no process stops being sampled for good.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from ..host import activity, procfs, untrusted
from ..host.user_limits import UserLimits
from ..model import ProcessId, Registration
from ..watch.stack_history import Sample
from .quiet import Quiet
from .stack import carried, counters, sockets, take_sample
from .stack_probe import StackProbe

log = structlog.get_logger("hangwatchd.daemon")

TakeSample = Callable[..., Sample]  # take_sample's signature: (pid, timeout, native, uid, act, locals=True)
PROBE_MAX_THREADS = 2  # processes of more threads are read by py-spy alone (the probe would cost more)
NATIVE_KEPT = 10_000  # last native looks kept (one a process, as many as the daemon watches)


@dataclass(frozen=True)
class SampleTaken:
    """One stack sample of ``process``, or why there is none (``sample.error``), or when to try
    again (``deferred``: its user's py-spy budget was spent, nothing was read)."""

    process: ProcessId
    native: bool  # the one native look at a frozen stack (not a plain sample)
    sample: Sample
    deferred: float | None = None  # monotonic: sample it again then


@dataclass(frozen=True)
class SampleBatch:
    """Samples taken together (the carried ones of one ``start_many``): each is one ``SampleTaken``."""

    taken: tuple[SampleTaken, ...]


def _failed(why: str) -> Sample:
    return Sample(time.monotonic(), (), (), None, None, why)


@dataclass(frozen=True)
class PaceSampled:
    """One low-rate sample of a rank for its job's pace (what its main thread does), or why there is none."""

    process: ProcessId
    sample: Sample


class Sampler:
    def __init__(self, pyspy_timeout: float, samples_per_uid: float, limits: UserLimits,
                 post: Callable[[object], None], take: TakeSample = take_sample, quiet: Quiet | None = None,
                 probe: StackProbe | None = None) -> None:
        self.pyspy_timeout = pyspy_timeout
        self.samples_per_uid = samples_per_uid
        self.limits = limits
        self.post = post  # the loop's queue
        self.take = take
        self.quiet = quiet if quiet is not None else Quiet()
        self.reads = 0  # py-spy runs started (plain and native)
        self.carried = 0  # samples carried forward without one
        self.probe = probe if probe is not None else StackProbe()
        self._probed: dict[ProcessId, str] = {}  # the probe's digest of each process when py-spy last read it
        self._budget = threading.Lock()  # the user's py-spy budget is spent from the workers
        self._native: dict[ProcessId, Sample] = {}  # the last native look at each process
        # At most one sample per process is in flight (the loop's Watched.sampling), so the pool's
        # queue is bounded by the watchlist's size.
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="sample")
        # The counters' looks (cheap, batched) on a thread of their own: never queued behind py-spy runs.
        self.looks = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sample-look")

    def start_quiet(self) -> None:
        self.quiet.start()

    def start(self, reg: Registration, native: bool, now: float, last: Sample | None = None) -> float | None:
        """Start one sample of ``reg``'s process (native: the one look at a frozen stack; ``last``: its
        latest plain sample, which a process that has not run since is given again). None: started,
        and a ``SampleTaken`` follows, always (``deferred`` when its user's py-spy budget was spent).
        A float would say when to try again (kept for the loop's contract; nothing is refused here)."""
        self.start_many([(reg, native, last)])
        return None

    def pace(self, reg: Registration, now: float) -> float | None:
        """Start one pace sample of ``reg``'s process (plain, no local variables: only what its main
        thread does); None when started (a ``PaceSampled`` follows, always), else when to try again.
        The same budget per user as the stack samples."""
        wait = self._charge(reg.uid)
        if wait:
            return now + wait
        self.pool.submit(self._take_pace, reg.process, reg.uid)
        return None

    def _take_pace(self, process: ProcessId, uid: int) -> None:
        sample = _failed("the sampler stopped before it finished")
        try:
            sample = self.take(process.pid, self.pyspy_timeout, False, uid, None, False)
        except Exception as exc:  # whatever it was, the loop hears of it as this sample's error
            log.exception("stack_sample_raised", pid=process.pid, error=f"{type(exc).__name__}: {exc}")
            sample = _failed(f"the sampler raised {type(exc).__name__}: {exc}")
        finally:
            self.post(PaceSampled(process, sample))

    def start_many(self, batch: Sequence[tuple[Registration, bool, Sample | None]]) -> None:
        """Start a sample of each (registration, native, last) as ``start`` does, together: one
        worker looks at them all and posts those it can carry as one ``SampleBatch`` (the loop
        wakes once for them), and hands each that needs py-spy to a worker of its own."""
        if batch:
            self.looks.submit(self._take_many, list(batch))

    def _spent(self, uid: int, now: float, wait: float) -> float:
        if self.limits.first("pyspy_rate", uid):
            log.warning("stack_sampling_limited", uid=uid, limit=f"pyspy_samples_per_uid = {self.samples_per_uid:g}")
        return now + wait

    def _charge(self, uid: int) -> float:
        """0.0 when ``uid`` may run py-spy now (its budget spent by one); else seconds until it may."""
        with self._budget:
            return self.limits.sample_wait(uid, time.monotonic())

    def _take_many(self, batch: list[tuple[Registration, bool, Sample | None]]) -> None:
        """On a worker: each of ``batch`` carried (posted together at the end) or handed to a worker
        that reads it; every one comes back as exactly one SampleTaken, whatever happens."""
        out: list[SampleTaken] = []
        done = 0
        try:
            for reg, native, last in batch:
                try:
                    again, act = self._carry(reg.process, native, last)
                    if again is not None:
                        out.append(SampleTaken(reg.process, native, again))
                    else:
                        self.pool.submit(self._take, reg.process, reg.uid, native, act, last)
                except Exception as exc:  # this one's error, as a value; the others go on
                    log.exception("stack_sample_raised", pid=reg.process.pid, error=f"{type(exc).__name__}: {exc}")
                    out.append(SampleTaken(reg.process, native, _failed(f"the sampler raised {type(exc).__name__}: {exc}")))
                done += 1
        finally:
            out += [SampleTaken(r.process, n, _failed("the sampler stopped before it finished")) for r, n, _ in batch[done:]]
            if out:
                self.post(SampleBatch(tuple(out)))

    def _carry(self, process: ProcessId, native: bool, last: Sample | None) -> tuple[Sample | None, activity.Activity]:
        """(its last stack again, where no thread of it ran since; else None, and its counters read now)."""
        pid = process.pid
        act = activity.read(pid)
        read_at = time.monotonic()
        before = self._native.get(process) if native else last
        if before is not None:
            again = carried(before, act, sockets(pid, min(1.0, self.pyspy_timeout)) if native else None)
            if again is not None:
                self.carried += 1
                self.quiet.follow(process, act.ran, read_at)
                return again, act
        return None, act

    def _take(self, process: ProcessId, uid: int, native: bool, act: activity.Activity, last: Sample | None = None) -> None:
        """On a worker: the sample read by py-spy, or the exception that stopped it, as a value on the loop's queue."""
        sample = _failed("the sampler stopped before it finished")
        deferred = None
        try:
            sample, deferred = self._read(process, uid, native, act, last)
        except Exception as exc:  # whatever it was, the loop hears of it as this sample's error
            log.exception("stack_sample_raised", pid=process.pid, error=f"{type(exc).__name__}: {exc}")
            sample = _failed(f"the sampler raised {type(exc).__name__}: {exc}")
        finally:
            self.post(SampleTaken(process, native, sample, deferred))

    def _read(self, process: ProcessId, uid: int, native: bool, act: activity.Activity,
              last: Sample | None = None) -> tuple[Sample, float | None]:
        pid = process.pid
        wait = self._charge(uid)
        if wait:
            return _failed("not sampled: its user's py-spy budget is spent"), self._spent(uid, time.monotonic(), wait)
        settled = self.quiet.settled(process, act.ran)
        state = None
        if not native:
            state, again = self._probe(process, uid, act, last)
            if again is not None:
                self.quiet.follow(process, act.ran, time.monotonic())
                return again, None
        self.reads += 1
        sample = self.take(pid, self.pyspy_timeout, native, uid, act)
        if not native:
            self._remember(process, uid, state, sample)
        if settled is not None and not sample.error and activity.ran(pid) == act.ran:
            # No thread ran from the quiet look that first saw these counters to the end of this
            # read: the stack read is the one it had all along.
            sample = dataclasses.replace(sample, since=settled)
        self.quiet.follow(process, act.ran, time.monotonic())
        if native and not sample.error:
            if len(self._native) >= NATIVE_KEPT:
                self._native = {p: s for p, s in self._native.items() if procfs.alive(p)}
            self._native[process] = sample
        return sample, None

    def _probe(self, process: ProcessId, uid: int, act: activity.Activity | None,
               last: Sample | None) -> tuple[str | None, Sample | None]:
        """(the probe's digest of the process now, or None; ``last`` carried forward, with ``act``, where
        the digest is the one that went with py-spy's last read, else None). Read only while the
        process is still its user's alone, before and after, as py-spy's reads are."""
        if act is not None and act.threads > PROBE_MAX_THREADS:
            return None, None  # pystack's read costs about 4 ms a thread: past two, py-spy's costs less
        try:
            untrusted.check_owner(process.pid, uid)
        except untrusted.Refused:
            return None, None  # py-spy's read says so, as a refused sample
        probed = self.probe.probe(process.pid, time.monotonic() + self.pyspy_timeout, uid)
        if probed is None or probed.running:
            return None, None  # no digest, or one of a process that ran while it was read (torn): py-spy reads
        try:
            untrusted.check_owner(process.pid, uid)
        except untrusted.Refused:
            return None, None
        if act is None or last is None or last.error or self._probed.get(process) != probed.state:
            return probed.state, None
        cpu, ctx = counters(process.pid)
        self.carried += 1
        return probed.state, dataclasses.replace(last, time=act.time, cpu_seconds=cpu, ctx_switches=ctx, activity=act,
                                                 python_running=False, since=None, read=False, probed=True)

    def _remember(self, process: ProcessId, uid: int, before: str | None, sample: Sample) -> None:
        """Keep the probe's digest that goes with py-spy's read of ``process``, or none (never an
        older read's): the digest read before it, where a probe right after reads the same, so that
        what py-spy read is that state (a process that moved during the read, from one line to the
        next and back, has none, and its next sample is py-spy's again)."""
        self._probed.pop(process, None)
        if before is None or sample.error:
            return
        after, _ = self._probe(process, uid, None, None)
        if after != before:
            return
        if len(self._probed) >= NATIVE_KEPT:
            self._probed = {p: d for p, d in self._probed.items() if procfs.alive(p)}
        self._probed[process] = before

    def shutdown(self) -> None:
        self.looks.shutdown(wait=True, cancel_futures=True)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.quiet.stop()
        self.probe.close()
