"""The capture pipeline: steps in order, each cut at the capture's one deadline, each outcome recorded.

A capture's deadline (``host.deadline.Deadline``) is set when the hang is
declared and handed down unchanged; every step runs by its own timeout or that
deadline, whichever comes first (``Deadline.cut``; the GPU dump too: a capture
never runs past its deadline). When a step runs is said on its type
(``Step.phase``). Whatever a step raises is that step's failure, recorded with
its traceback in the log; the next step runs.

A step that only watches over a window (``WindowStep``) can be run in two halves,
``Opening`` and ``Closing``, each a step of its own; ``whole`` makes their one
result, logged and counted once (``record``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import structlog

from ..host.deadline import Deadline
from ..metrics import Metrics
from ..model import ProcessCapture, Registration, StepResult
from .base import Phase, Step, StepFailed, StepNotApplicable, WindowStep
from .parallel import run_across

log = structlog.get_logger("hangwatchd.capture")


def vetoed(step: Step, target: Registration, outdir: Path, gate: Callable[[Path], str | None] | None) -> StepResult | None:
    """The skipped result of a destructive step the policy refuses (``gate(outdir)`` gave a reason,
    or there is no gate), logged; None where the step may run."""
    if step.phase is not Phase.DESTRUCTIVE:
        return None
    veto = gate(outdir) if gate else "no policy allows destructive steps here"
    if not veto:
        return None
    log.info("capture_step_skipped", pid=target.process.pid, step=step.name, why=veto)
    return StepResult(step.name, True, 0.0, f"skipped: {veto}", skipped=True)


def run_steps(
    steps: Sequence[tuple[Step, float]],
    target: Registration,
    outdir: Path,
    deadline: Deadline,
    metrics: Metrics | None = None,
    gate: Callable[[Path], str | None] | None = None,
) -> ProcessCapture:
    """Run each (step, timeout) on ``target`` into ``outdir``, each by its timeout or ``deadline``,
    whichever comes first; never raises for a step's failure. Past the deadline the remaining
    steps are skipped, and say so. A destructive step (the GPU dump) runs only if ``gate(outdir)``
    gives no reason against it, after seeing what the earlier steps captured."""
    outdir.mkdir(parents=True, exist_ok=True)
    results: list[StepResult] = []
    for step, timeout in steps:
        refused = vetoed(step, target, outdir, gate)
        if refused:
            results.append(refused)
            continue
        if deadline.passed():
            results.append(StepResult(step.name, False, 0.0, "skipped: the capture's time budget was spent", skipped=True))
            continue
        start = time.monotonic()
        try:
            files = step.run(target, outdir, deadline.cut(timeout, start))
            result = StepResult(step.name, True, time.monotonic() - start, files=tuple(files))
        except StepNotApplicable as exc:  # nothing to capture here (no GPU, no process group): not a failure
            result = StepResult(step.name, True, time.monotonic() - start, str(exc), not_applicable=True)
        except StepFailed as exc:
            result = StepResult(step.name, False, time.monotonic() - start, str(exc))
        except OSError as exc:  # a full disk, a vanished directory: the step fails, the pipeline goes on
            result = StepResult(step.name, False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug in one step (or input a user shaped to break it) is that step's failure
            result = StepResult(step.name, False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
            log.error("capture_step_raised", pid=target.process.pid, step=step.name, error=result.error, exc_info=exc)
        results.append(result)
        if not getattr(step, "half", False):
            record(target, result, metrics)
    return ProcessCapture(target, tuple(results))


def record(target: Registration, result: StepResult, metrics: Metrics | None) -> None:
    """A step's result logged, and counted in the metrics."""
    if metrics is not None:
        metrics.step_duration.labels(**metrics.labels(step=result.step)).observe(result.seconds)
        if not result.ok:
            metrics.step_failures.labels(**metrics.labels(step=result.step)).inc()
    log.info("capture_step", pid=target.process.pid, step=result.step, ok=result.ok, na=result.not_applicable,
             seconds=round(result.seconds, 3), error=result.error, files=list(result.files))


Seen = dict[tuple[int, str], tuple[float, object]]  # (pid, step name) -> when a window step's first look ended, what it saw


@dataclass
class _Half:
    """One of a window step's two looks, a step of its own (beside the rank's other steps), named as
    the step. A half: not logged or counted (``whole`` is)."""

    step: WindowStep
    seen: Seen
    name: str = field(init=False)
    phase: ClassVar[Phase] = Phase.BESIDE
    half: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.name = self.step.name


@dataclass
class Opening(_Half):
    """A window step's first look: what it saw is kept in ``seen`` for its ``Closing``."""

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        opened = self.step.open(target, deadline)
        self.seen[(target.process.pid, self.name)] = (time.monotonic(), opened)
        return ()


@dataclass
class Closing(_Half):
    """A window step's second look, against what its ``Opening`` saw on the same process."""

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        seen = self.seen.get((target.process.pid, self.name))
        if seen is None:
            raise StepFailed("its first look was not taken")
        return self.step.close(target, outdir, deadline, seen[1])


def whole(opened: StepResult, closed: StepResult) -> StepResult:
    """A window step's one result from its halves: the first's failure, else the second's outcome,
    with the time both worked (not the window between them)."""
    if not opened.ok or opened.skipped:
        return opened
    return dataclasses.replace(closed, seconds=opened.seconds + closed.seconds)


def capture_all(
    steps: Sequence[tuple[Step, float]],
    targets: Sequence[Registration],
    outdir: Path,
    deadline: Deadline,
    metrics: Metrics | None = None,
    gate: Callable[[Path], str | None] | None = None,
) -> list[ProcessCapture]:
    """Capture every target into ``outdir/PID``: the gentle steps on every target, then the destructive ones."""
    # Everything gentle on every rank first: a GPU dump ends its process, and a launcher
    # like torchrun then tears down the other ranks before they could be read.
    gentle = [(s, t) for s, t in steps if s.phase is not Phase.DESTRUCTIVE]
    last = [(s, t) for s, t in steps if s.phase is Phase.DESTRUCTIVE]
    # The GPU dump's time, held back from the gentle steps (half the time left where it is more than that).
    dump_time = sum(t for _, t in last)
    left = deadline.left()
    gentle_by = deadline.sooner(dump_time if dump_time < left else left / 2) if last else deadline

    def one(ss: Sequence[tuple[Step, float]], t: Registration, outdir_: Path, by: Deadline) -> ProcessCapture:
        destructive = any(s.phase is Phase.DESTRUCTIVE for s, _ in ss)
        return run_steps(ss, t, outdir_, by if destructive else min(by, gentle_by), metrics, gate)

    return run_across(gentle + last, targets, lambda t: outdir / str(t.process.pid), deadline, one)
