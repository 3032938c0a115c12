"""When a captured hang may be declared again: only after the process shows progress.

A captured process stays hung in our eyes until it does something a hung
process does not: a new beat, for a process that beats; a different stack,
for one watched by its stack alone. Anything less (a history reset, a stack
that wobbles in a wait loop while the beats stay silent) would declare the
same hang twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..watch.stack_history import Sample
from ..watch.watched import Watched


@dataclass(frozen=True)
class ProgressMark:
    """Where a process stood when it was declared hung."""

    beats: int | None  # its beat count; None when it never beat (its stack is the only sign)
    signature: tuple | None  # type: ignore[type-arg]  # its last stack; None when none was sampled


def mark(w: Watched) -> ProgressMark:
    beats = w.beat.count if w.beat is not None and w.beat.count else None
    sig = w.history.samples[-1].signature if w.history.samples else None
    return ProgressMark(beats, sig)


def with_sample(m: ProgressMark, sample: Sample) -> ProgressMark:
    """A stack-only mark that had no stack yet takes the first one seen after the hang."""
    if m.beats is None and m.signature is None and not sample.error:
        return ProgressMark(None, sample.signature)
    return m


def progressed(w: Watched, m: ProgressMark) -> str | None:
    """Why the process counts as making progress again since ``m``, or None."""
    if m.beats is not None:
        count = w.beat.count if w.beat is not None else 0
        return f"{count - m.beats} new beats" if count > m.beats else None
    if w.beat is not None and w.beat.count:
        return "its first beats"
    last = w.history.samples[-1] if w.history.samples else None
    if last is not None and m.signature is not None and last.signature != m.signature:
        return "its stack moved"
    return None
