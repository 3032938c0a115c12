"""Capture steps, one a file, switched on by name in the config and run in order by the pipeline."""

from __future__ import annotations

from ..config import Config
from .base import Step, StepFailed
from .pipeline import run_steps
from .proc import ProcStep
from .pyspy import PySpyStep


def make_steps(config: Config) -> list[tuple[Step, float]]:
    """The configured steps with their timeouts, cheapest and least destructive first."""
    factories = {
        "proc": lambda: (ProcStep(), 5.0),
        "pyspy": lambda: (PySpyStep(native=config.pyspy_native), config.pyspy_timeout),
    }
    return [factories[name]() for name in config.capture_steps]


__all__ = ["Step", "StepFailed", "make_steps", "run_steps"]
