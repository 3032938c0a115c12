"""Detectors: one a file, each answering "has this process stopped making progress?"."""

from __future__ import annotations

from typing import Any

__all__ = ["Detector", "Observation", "HeartbeatDetector"]


def __getattr__(name: str) -> Any:
    # Loaded when first named: the analysis imports only the frame catalogue (detect.patterns),
    # and `hangwatchd show` must not pay for the daemon's detectors, metrics and logging.
    if name in ("Detector", "Observation"):
        from . import base

        return getattr(base, name)
    if name == "HeartbeatDetector":
        from .heartbeat import HeartbeatDetector

        return HeartbeatDetector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
