"""The one small interface every detector implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..model import State, Suspicion
from ..watch.watched import Watched


@dataclass(frozen=True)
class Observation:
    """What a detector concluded about one process, and when it wants to look again."""

    state: State
    next_check: float  # monotonic seconds
    suspicion: Suspicion | None = None


class Detector(Protocol):
    name: str

    def observe(self, watched: Watched, now: float) -> Observation:
        """Look at the process now (monotonic seconds); never block."""
        ...
