"""The capture in two stages: what a person needs first (facts, stacks, GPU state), then the slow
evidence (flight recorders, GPU dumps), which is added to the incident after it is stored.

On an H200 the flight recorder took 4.6 s and a GPU dump 2.7 s; one rank whose
dump never came held a whole job's incident in ``.partial-`` for minutes. So the
incident is stored once every rank's stacks are in, and each rank's slow steps
run on their own, each under its own deadline, handing over what they wrote as
soon as that rank is done: no rank waits for another's dump.

The gentle slow steps (the flight recorder) start with the first stage, not after it:
PyTorch 2.11 took 3.4 to 6.5 s between reading its pipe and writing its trace on an H200
(its first dump imports torch._inductor, unless a torch.compile user has it already; then
it is in at once), and that time passes while the stacks are taken. What
they wrote is handed over once the incident is stored (``Stored``). The GPU dump, which
ends the process, waits for the incident to be stored and for the trace, or at most
``HEAD_START`` seconds from the trace's request.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import structlog

from ..host.deadline import Deadline
from ..metrics import Metrics
from ..model import Registration, StepResult
from .base import Phase, Step
from .pipeline import run_steps

log = structlog.get_logger("hangwatchd.capture")

HEAD_START = 10.0  # seconds from the flight recorder's request to the GPU dump that ends its process


class Stored:
    """Whether the incident the slow steps add to has been stored: set once, with the incident
    (anything but None) or None when it was not stored, or not where evidence can be added."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._what: object | None = None

    def set(self, what: object | None) -> None:
        self._what = what
        self._set.set()

    def wait(self) -> object | None:
        # No deadline of its own: whoever stores the incident sets this on every path, failure
        # included (make_incident), and storing is cut at the capture's deadline. A timeout here
        # would only drop evidence that the stored incident still lists as coming.
        self._set.wait()
        return self._what


def split(steps: Sequence[tuple[Step, float]]) -> tuple[list[tuple[Step, float]], list[tuple[Step, float]]]:
    """(the steps stored first, the steps added after: LATE and DESTRUCTIVE ones, slow, and nothing in
    the verdict's first line waits on them), each in the configured order."""
    return [x for x in steps if x[0].phase.stored_first], [x for x in steps if not x[0].phase.stored_first]


StepDone = Callable[[Registration, Path, StepResult], None]
Taken = Callable[[Registration, StepResult], bool]
Early = Callable[[Registration, Path], None]

# A step's output dir -> what hands over the files it has finished so far (a GPU dump's
# symbolized.json, while the dump itself is still being compressed). Set while the step runs.
_early: dict[str, Callable[[], None]] = {}
_early_lock = threading.Lock()


def publish(outdir: Path) -> None:
    """A step has finished some of its files in ``outdir``: hand them over now, where someone
    takes them (a late step of a stored incident); nothing otherwise."""
    with _early_lock:
        fn = _early.get(str(outdir))
    if fn is not None:
        try:
            fn()
        except Exception as exc:  # handing over early is a favour: the step goes on
            log.error("early_evidence_failed", dir=str(outdir), error=f"{type(exc).__name__}: {exc}", exc_info=True)


def run_late(
    steps: Sequence[tuple[Step, float]],
    targets: Sequence[Registration],
    outdir_of: Callable[[Registration, str], Path],
    gate: Callable[[Path], str | None] | None,
    metrics: Metrics | None,
    done: StepDone,
    deadline: Deadline,
    head_start: float = HEAD_START,
    early: Early | None = None,
    stored: Stored | None = None,
    refused: Collection[tuple[int, str]] = (),
    taken: Taken | None = None,
) -> None:
    """Run the late ``steps`` on every target at once, each step into its own ``outdir_of(target,
    step)``; call ``done(target, outdir, result)`` on that step's thread as soon as it is over,
    so each piece of evidence is handed over as it comes, and ``early(target, outdir)`` where a
    step has finished some of its files before it is over (``publish``). Returns when every
    rank is done. ``deadline``: the capture's; no step runs past it.

    ``stored``: the incident is being stored meanwhile. The gentle steps run at once and hand
    over once it is stored; the destructive ones start only then. Not stored: what was
    written is removed, and nothing destructive runs. ``refused`` (pid, step name): destructive
    steps the policy refused, said in the stored incident already: not run. ``taken(target,
    result)``: a result that came before the incident was stored, offered to go in it as first
    stored (True: taken there, not handed over after)."""
    if not steps or not targets:
        return
    gentle = [x for x in steps if x[0].phase is not Phase.DESTRUCTIVE]
    last = [x for x in steps if x[0].phase is Phase.DESTRUCTIVE]

    def one(target: Registration, step: Step, timeout: float, step_gate: Callable[[Path], str | None] | None,
            ran: threading.Event | None = None) -> None:
        outdir = outdir_of(target, step.name)
        if early is not None:
            with _early_lock:
                _early[str(outdir)] = lambda: early(target, outdir)
        try:
            # Each by its own timeout from when it starts, whatever the others took, cut at the capture's deadline.
            results = run_steps([(step, timeout)], target, outdir, deadline, metrics, step_gate).steps
        finally:
            with _early_lock:
                _early.pop(str(outdir), None)
            if ran is not None:
                ran.set()  # the next lane need not wait for the hand-over (which re-reads the incident)
        if taken is not None:
            results = tuple(r for r in results if not taken(target, r))
            if not results:
                shutil.rmtree(outdir, ignore_errors=True)  # in the incident as first stored
                return
        if stored is not None and stored.wait() is None:
            shutil.rmtree(outdir, ignore_errors=True)  # no incident to add it to
            return
        for result in results:
            try:
                done(target, outdir, result)
            except Exception as exc:  # the incident is stored: one rank's bug must not undo it
                log.error("late_evidence_failed", pid=target.process.pid, step=result.step,
                          error=f"{type(exc).__name__}: {exc}", exc_info=True)

    def rank(target: Registration) -> None:
        gentle_done = threading.Event()
        asked = time.monotonic()

        def first() -> None:
            try:
                for i, (step, timeout) in enumerate(gentle):
                    one(target, step, timeout, None, gentle_done if i == len(gentle) - 1 else None)
            finally:
                gentle_done.set()

        lane = threading.Thread(target=first, name=f"late-{target.process.pid}", daemon=True)
        lane.start()
        if last and (stored is None or stored.wait() is not None):
            gentle_done.wait(max(0.0, asked + head_start - time.monotonic()))
            for step, timeout in last:
                if (target.process.pid, step.name) not in refused:
                    one(target, step, timeout, gate)
        # Its steps are cut at the capture's deadline; a lane past it (a bug) is left behind, not waited for.
        lane.join(deadline.left() + 5.0)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="late") as pool:
        for f in [pool.submit(rank, t) for t in targets]:
            f.result()
