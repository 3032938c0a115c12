"""Stack samples of a watched process and the run of them that share one stack."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KEEP = 32  # samples of a run kept: its first (when it started) and the latest (how it goes); an idle process holds one stack for days


@dataclass(frozen=True)
class Sample:
    time: float  # monotonic
    signature: tuple[tuple[tuple[str, str, int], ...], ...]
    frames: tuple[str, ...]  # every frame name, for the pattern checks
    cpu_seconds: float | None  # all threads, so far
    ctx_switches: int | None
    error: str | None = None
    refused: bool = False  # not taken: the process is no longer its registered user's alone


def signature_of(threads: Sequence[dict[str, Any]]) -> tuple[tuple[tuple[str, str, int], ...], ...]:
    sig = []
    for t in threads:
        frames = tuple((str(f.get("name")), str(f.get("filename")), int(f.get("line") or 0)) for f in t.get("frames") or [])
        sig.append(frames)
    return tuple(sorted(sig))


@dataclass(frozen=True)
class StackHistory:
    """The samples of one process since its stack last changed (a value: ``added`` makes the next)."""

    samples: tuple[Sample, ...] = ()  # the run's first sample and its latest ones (KEEP at most)
    count: int = 0  # samples in the run, all of them

    def added(self, s: Sample) -> StackHistory:
        """The history with ``s`` in it: a sample that failed changes nothing, another stack starts over."""
        if s.error:
            return self
        if self.samples and self.samples[-1].signature != s.signature:
            return StackHistory((s,), 1)
        kept = self.samples if len(self.samples) < KEEP else (self.samples[0], *self.samples[2:])
        return StackHistory((*kept, s), self.count + 1)

    def frozen_for(self) -> float:
        """Seconds the same stack has held (0 with fewer than two samples)."""
        if len(self.samples) < 2:
            return 0.0
        return self.samples[-1].time - self.samples[0].time

    def cpu_share(self) -> float | None:
        """CPU seconds per second over the run (1.0: one core busy all along)."""
        first, last = self.samples[0], self.samples[-1]
        span = last.time - first.time
        if first.cpu_seconds is None or last.cpu_seconds is None or span <= 0:
            return None
        return (last.cpu_seconds - first.cpu_seconds) / span

    def evidence(self) -> str:
        first, last = self.samples[0], self.samples[-1]
        parts = [f"{self.count} samples with the same stack over {self.frozen_for():.0f} s"]
        if first.cpu_seconds is not None and last.cpu_seconds is not None:
            parts.append(f"CPU +{last.cpu_seconds - first.cpu_seconds:.2f} s")
        if first.ctx_switches is not None and last.ctx_switches is not None:
            parts.append(f"context switches +{last.ctx_switches - first.ctx_switches}")
        return ", ".join(parts)
