"""The one small interface every capture step implements."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..model import Registration


class StepFailed(Exception):
    """The step could not do its job; the message says why, for the incident and the log."""


class Step(Protocol):
    name: str  # a step may also set ``destructive = True``: it runs last, and only when policy allows

    def run(self, target: Registration, outdir: Path, timeout: float) -> tuple[str, ...]:
        """Capture into ``outdir`` within ``timeout`` seconds; return the files written.

        Raise StepFailed with one clear line when it cannot."""
        ...
