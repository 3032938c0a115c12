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

from ..host.deadline import Deadline
from ..model import ProcessCapture, Registration, StepResult
from .base import Phase, Step

OVERRUN = 5.0  # seconds past the capture's deadline a step may take to notice it before its result is given up

RunSteps = Callable[[Sequence[tuple[Step, float]], Registration, Path, Deadline], ProcessCapture]


def phases(steps: Sequence[tuple[Step, float]]) -> list[list[tuple[Step, float]]]:
    """Split the steps at each step that must start together on every rank (a LATE one, whose moment
    matters across ranks: after a barrier) and at the GPU dump."""
    out: list[list[tuple[Step, float]]] = [[]]
    for step, timeout in steps:
        alone = step.phase in (Phase.LATE, Phase.DESTRUCTIVE)
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
    deadline: Deadline,
    run_steps: RunSteps,
) -> list[ProcessCapture]:
    """Run ``steps`` on every target, a thread per target, phase by phase, all by ``deadline``; the
    results in targets' order."""
    results: list[list[StepResult]] = [[] for _ in targets]
    if not targets:
        return []
    beside = max((sum(1 for s, _ in p if s.phase is Phase.BESIDE) for p in phases(steps)), default=0)
    # Not a ``with`` block: leaving one waits for every thread, and a step that ignores its
    # deadline (a bug) must cost its own result, not hold the capture past the deadline.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(targets) * (1 + beside), thread_name_prefix="rank")
    try:
        for phase in phases(steps):
            started = time.monotonic()
            # A BESIDE step (it only watches over a window, or asks the driver) runs beside the rank's other steps.
            lanes = [[x for x in phase if x[0].phase is not Phase.BESIDE]] + [[x] for x in phase if x[0].phase is Phase.BESIDE]
            lanes = [lane for lane in lanes if lane]
            futures = [[(lane, pool.submit(run_steps, lane, t, outdir_of(t), deadline)) for lane in lanes] for t in targets]
            order = {step.name: k for k, (step, _) in enumerate(phase)}
            for i, fs in enumerate(futures):
                done: list[StepResult] = []
                for lane, f in fs:
                    try:
                        done += f.result(timeout=deadline.left() + OVERRUN).steps
                    except concurrent.futures.TimeoutError:
                        done += [StepResult(s.name, False, time.monotonic() - started, "did not return by the capture's deadline")
                                 for s, _ in lane]
                results[i].extend(sorted(done, key=lambda r: order.get(r.step, len(order))))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [ProcessCapture(t, tuple(r)) for t, r in zip(targets, results)]
