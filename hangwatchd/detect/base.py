"""The one small interface every detector implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..model import State, Suspicion
from ..watch.watched import Watched


@dataclass(frozen=True)
class Observation:
    """What a detector concluded about one process, and when it wants to look again."""

    state: State
    next_check: float  # monotonic seconds
    suspicion: Suspicion | None = None
    # What the look learned of the process (fields of Watched: its beat, its last progress, a
    # learned timeout, ...): the state machine writes them through Watchlist.change, the detector never.
    learned: dict[str, Any] = field(default_factory=dict)


class Detector(Protocol):
    name: str

    def observe(self, watched: Watched, now: float) -> Observation:
        """Look at the process now (monotonic seconds); never block, never write ``watched``."""
        ...
