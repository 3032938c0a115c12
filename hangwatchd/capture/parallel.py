"""Every rank on a node at once: the gentle steps run beside each other, the flight recorders are
triggered together, and only then the GPU dumps (which end the processes).

One rank after another, eight ranks took eight times the slowest rank's time
(the flight recorder alone took 4.6 s for one rank on an H200), and the ranks
read last had moved on, or been torn down, by the time they were read.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..model import ProcessCapture, Registration, StepResult
from .base import Step

# Steps whose moment matters across ranks: they start on every rank together, after a barrier.
TOGETHER = frozenset({"flight_recorder"})
OVERRUN = 5.0  # seconds past the capture's deadline a step may take to notice it before its result is given up

RunSteps = Callable[[Sequence[tuple[Step, float]], Registration, Path, float], ProcessCapture]


def phases(steps: Sequence[tuple[Step, float]]) -> list[list[tuple[Step, float]]]:
    """Split the steps at each step that must start together on every rank (and at the GPU dump)."""
    out: list[list[tuple[Step, float]]] = [[]]
    for step, timeout in steps:
        alone = step.name in TOGETHER or getattr(step, "destructive", False)
        if alone and out[-1]:
            out.append([])
        out[-1].append((step, timeout))
        if alone:
            out.append([])
    return [p for p in out if p]


def run_across(
    steps: Sequence[tuple[Step, float]],
    targets: Sequence[Registration],
    outdir_of: Callable[[Registration], Path],
    budget: float,
    run_steps: RunSteps,
) -> list[ProcessCapture]:
    """Run ``steps`` on every target, a thread per target, phase by phase; the results in targets' order."""
    results: list[list[StepResult]] = [[] for _ in targets]
    end = time.monotonic() + budget
    if not targets:
        return []
    beside = max((sum(1 for s, _ in p if getattr(s, "beside", False)) for p in phases(steps)), default=0)
    # Not a ``with`` block: leaving one waits for every thread, and a step that ignores its
    # deadline (a bug) must cost its own result, not hold the capture past the deadline.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(targets) * (1 + beside), thread_name_prefix="rank")
    try:
        for phase in phases(steps):
            left = max(0.0, end - time.monotonic())
            # A step that only watches over a window (``beside = True``) runs beside the rank's other steps.
            lanes = [[x for x in phase if not getattr(x[0], "beside", False)]] + [[x] for x in phase if getattr(x[0], "beside", False)]
            lanes = [lane for lane in lanes if lane]
            futures = [[(lane, pool.submit(run_steps, lane, t, outdir_of(t), left)) for lane in lanes] for t in targets]
            order = {step.name: k for k, (step, _) in enumerate(phase)}
            for i, fs in enumerate(futures):
                done: list[StepResult] = []
                for lane, f in fs:
                    try:
                        done += f.result(timeout=max(0.0, end - time.monotonic()) + OVERRUN).steps
                    except concurrent.futures.TimeoutError:
                        done += [StepResult(s.name, False, left, "did not return by the capture's deadline") for s, _ in lane]
                results[i].extend(sorted(done, key=lambda r: order.get(r.step, len(order))))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [ProcessCapture(t, tuple(r)) for t, r in zip(targets, results)]
