"""Detectors: one a file, each answering "has this process stopped making progress?"."""

from .base import Detector, Observation
from .heartbeat import HeartbeatDetector

__all__ = ["Detector", "Observation", "HeartbeatDetector"]
