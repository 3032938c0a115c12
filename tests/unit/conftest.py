"""The fast tier: the state machine, the loop's rooms and the capture's timing rules, run in this
process with a stub clock (every ``now`` is given) and stub detectors and workers: no daemon, no
subprocess, no sleep. ``./dev test --fast`` runs this directory alone."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hangwatchd.config import Config
from hangwatchd.detect.base import Observation
from hangwatchd.detect.machine import Decision, Declare, StateMachine
from hangwatchd.metrics import Metrics, create
from hangwatchd.model import ProcessId, Registration, State, Suspicion
from hangwatchd.watch.watched import Watched, Watchlist

ME = 1000  # an ordinary user (root is never held to a budget)
OTHER = ME + 1000  # another user: never a job-mate of ME's processes


@dataclass
class StubDetector:
    """What the heartbeat detector would say, scripted per pid: healthy unless told otherwise."""

    says: dict[int, Observation] = field(default_factory=dict)
    name: str = "stub"

    def observe(self, w: Watched, now: float) -> Observation:
        return self.says.get(w.process.pid, Observation(State.HEALTHY, now + 5.0))


def hang(now: float, reason: str = "heartbeat") -> Observation:
    return Observation(State.SUSPECT, now, Suspicion(reason, "no beat for 9 s", 0.0, (reason,)))


@dataclass
class Node:
    """A watchlist and its state machine, as the loop holds them; the metrics in their own registry."""

    metrics: Metrics
    watched: Watchlist
    detector: StubDetector
    machine: StateMachine
    pids: int = 10_000_000  # never a live process: Watched.check_files finds no process, which is fine

    def add(self, uid: int = ME, job: str | None = "train", state: State = State.HEALTHY, rank: int | None = None,
            role: str = "workload", now: float = 0.0) -> Watched:
        self.pids += 1
        reg = Registration(ProcessId(self.pids, 1), uid=uid, job=job, rank=rank, role=role, cmdline=("python", "train.py"))
        w = Watched(reg, state, seen_at=now, timeout=10.0, role=role, next_check=now)
        assert self.watched.admit(w)
        return w

    def counter(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, {**self.metrics.const, **labels})
        return value or 0.0

    def declare(self, w: Watched, now: float) -> Declare:
        """Make ``w`` hung by its detector's word (a suspicion, then its confirmation); the Declare it brings."""
        self.detector.says[w.process.pid] = hang(now)
        assert self.machine.observe(w, now) == []  # suspect: one more look before anything is done
        decided = self.machine.observe(w, now + 1.0)
        (d,) = decided
        assert isinstance(d, Declare)
        return d


def declares(decided: list[Decision]) -> list[Declare]:
    return [d for d in decided if isinstance(d, Declare)]


@pytest.fixture
def node() -> Iterator[Node]:
    metrics = create(CollectorRegistry(), node="unit")
    watched = Watchlist(metrics)
    detector = StubDetector()
    cfg = Config(state_dir="/nonexistent", runtime_dir="/nonexistent-run", capture_timeout=30.0, gpu_dump="never")
    machine = StateMachine(cfg, detector, watched, metrics, ("synchronize",), "idle_wait", capture_budget=30.0)
    yield Node(metrics, watched, detector, machine)
    assert watched.illegal == 0, "an illegal transition happened (its traceback is in the log)"


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d
