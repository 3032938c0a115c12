"""When each capture step runs and by when: said on the step's type (``Phase``), cut at the one
deadline made when the hang was declared. Stub steps record what they were given."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import ClassVar

from hangwatchd.capture import late, make_steps
from hangwatchd.capture.base import Phase, Step
from hangwatchd.capture.parallel import phases
from hangwatchd.capture.pipeline import capture_all, run_steps
from hangwatchd.config import Config
from hangwatchd.host.deadline import Deadline
from hangwatchd.model import ProcessId, Registration

TARGETS = [Registration(ProcessId(10_000_001 + i, 1), uid=1000, job="j") for i in range(2)]


class Stub:
    phase: ClassVar[Phase] = Phase.FIRST

    def __init__(self, name: str, seen: dict[tuple[int, str], tuple[Deadline, str]]) -> None:
        self.name = name
        self.seen = seen

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        self.seen[(target.process.pid, self.name)] = (deadline, threading.current_thread().name)
        return ()


class Beside(Stub):
    phase = Phase.BESIDE


class Late(Stub):
    phase = Phase.LATE


class Dump(Stub):
    phase = Phase.DESTRUCTIVE


def test_every_configured_step_says_when_it_runs() -> None:
    steps = make_steps(Config())
    assert {s.name: s.phase for s, _ in steps} == {
        "proc": Phase.FIRST, "progress": Phase.BESIDE, "pyspy": Phase.FIRST, "children": Phase.FIRST,
        "exits": Phase.FIRST, "introspect": Phase.FIRST, "nvml": Phase.BESIDE, "nccl_ras": Phase.BESIDE,
        "flight_recorder": Phase.LATE, "cuda_dump": Phase.DESTRUCTIVE}
    first, later = late.split(steps)
    assert [s.name for s, _ in later] == ["flight_recorder", "cuda_dump"]  # added to the incident after it is stored
    assert all(s.phase.stored_first for s, _ in first)


def test_one_deadline_cuts_every_step_and_the_gpu_dump_keeps_its_time(tmp_path: Path) -> None:
    seen: dict[tuple[int, str], tuple[Deadline, str]] = {}
    steps: list[tuple[Step, float]] = [(Stub("proc", seen), 5.0), (Beside("nvml", seen), 1000.0), (Stub("pyspy", seen), 1000.0),
                                       (Late("flight_recorder", seen), 1000.0), (Dump("cuda_dump", seen), 40.0)]
    assert [[s.name for s, _ in p] for p in phases(steps)] == [["proc", "nvml", "pyspy"], ["flight_recorder"], ["cuda_dump"]]
    deadline = Deadline.after(100.0)
    capture_all(steps, TARGETS, tmp_path, deadline, gate=lambda _d: None)
    done = time.monotonic()
    for t in TARGETS:
        pid = t.process.pid
        assert seen[(pid, "proc")][0].at <= deadline.sooner(95.0).at + 1.0  # its own 5 s, from when it started
        for name in ("nvml", "pyspy", "flight_recorder"):
            assert seen[(pid, name)][0] == deadline.sooner(40.0)  # the GPU dump's 40 s held back from the gentle steps
        # The dump: its own 40 s from when it started, which fits in the time held back for it.
        assert done + 40.0 - 1.0 <= seen[(pid, "cuda_dump")][0].at <= min(done + 40.0, deadline.at)


def test_past_the_deadline_the_steps_left_say_they_were_skipped(tmp_path: Path) -> None:
    seen: dict[tuple[int, str], tuple[Deadline, str]] = {}
    cap = run_steps([(Stub("proc", seen), 5.0)], TARGETS[0], tmp_path / "x", Deadline(0.0))
    (r,) = cap.steps
    assert r.skipped and "budget was spent" in (r.error or "") and seen == {}


def test_a_destructive_step_runs_only_where_the_policy_allows(tmp_path: Path) -> None:
    seen: dict[tuple[int, str], tuple[Deadline, str]] = {}
    cap = run_steps([(Dump("cuda_dump", seen), 5.0)], TARGETS[0], tmp_path / "x", Deadline.after(60.0),
                    gate=lambda _d: "gpu_dump = never")
    (r,) = cap.steps
    assert r.skipped and r.error == "skipped: gpu_dump = never" and seen == {}
