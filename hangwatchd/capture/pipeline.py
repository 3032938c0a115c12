"""The capture pipeline: steps in order, each with a deadline, each outcome recorded."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from ..metrics import Metrics
from ..model import ProcessCapture, Registration, StepResult
from .base import Step, StepFailed

log = structlog.get_logger("hangwatchd.capture")


def run_steps(
    steps: Sequence[tuple[Step, float]],
    target: Registration,
    outdir: Path,
    budget: float,
    metrics: Metrics | None = None,
) -> ProcessCapture:
    """Run each (step, timeout) on ``target`` into ``outdir``; never raises for a step's failure.

    A step gets its own timeout or what is left of ``budget``, whichever is less;
    when the budget is spent the remaining steps are skipped, and say so.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + budget
    results: list[StepResult] = []
    for step, timeout in steps:
        left = end - time.monotonic()
        if left <= 0:
            results.append(StepResult(step.name, False, 0.0, "skipped: the capture's time budget was spent", skipped=True))
            continue
        start = time.monotonic()
        try:
            files = step.run(target, outdir, min(timeout, left))
            result = StepResult(step.name, True, time.monotonic() - start, files=tuple(files))
        except StepFailed as exc:
            result = StepResult(step.name, False, time.monotonic() - start, str(exc))
        except OSError as exc:  # a full disk, a vanished directory: the step fails, the pipeline goes on
            result = StepResult(step.name, False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
        results.append(result)
        if metrics is not None:
            metrics.step_duration.labels(**metrics.labels(step=step.name)).observe(result.seconds)
            if not result.ok:
                metrics.step_failures.labels(**metrics.labels(step=step.name)).inc()
        log.info("capture_step", pid=target.process.pid, step=step.name, ok=result.ok,
                 seconds=round(result.seconds, 3), error=result.error, files=list(result.files))
    return ProcessCapture(target, tuple(results))
