"""When a captured hang may be declared again: only after progress a hung process cannot show.

A captured process stays hung in our eyes until it does something a hung
process does not: a new beat, for a process that beats; for one watched by its
stack alone, or one whose beats went on while its hung stack held still (they
come from a side thread), a stack other than the hung one in two plain samples
in a row.
Like is compared with like: the mark is a plain sample, and only plain samples
are held against it (a ``--native`` sample shows C frames a plain one never
does, so it always "differs"). One odd sample (a sleep loop caught between two
sleeps, a torn read) is not progress either. Anything less would declare the
same hang twice.
"""

from __future__ import annotations

from dataclasses import replace

from ..watch.stack_history import Sample
from ..watch.watched import ProgressMark, Watched

MOVED_SAMPLES = 2  # plain samples in a row that must differ from the hung stack


def mark(w: Watched) -> ProgressMark:
    """Where ``w`` stands now. A process that beat while its stack held still (its beats come from a
    side thread, not from what is stuck) is marked by its stack alone."""
    since = w.history.frozen_from()
    aside = w.last_progress is not None and since is not None and w.last_progress > since
    beats = w.beat.count if w.beat is not None and w.beat.count and not aside else None
    sig = w.history.samples[-1].signature if w.history.samples else None
    return ProgressMark(beats, sig, beats_aside=aside)


def with_sample(m: ProgressMark, sample: Sample) -> ProgressMark:
    """The mark after one more plain sample: a stack-only mark with no stack yet takes this one;
    otherwise the run of samples unlike the hung stack grows, or starts over."""
    if sample.error or m.beats is not None:
        return m
    if m.signature is None:
        return ProgressMark(None, sample.signature)
    return replace(m, moved=m.moved + 1 if sample.signature != m.signature else 0)


def progressed(w: Watched, m: ProgressMark) -> str | None:
    """Why the process counts as making progress again since ``m``, or None."""
    if m.beats is not None:
        count = w.beat.count if w.beat is not None else 0
        return f"{count - m.beats} new beats" if count > m.beats else None
    if w.beat is not None and w.beat.count and not m.beats_aside:
        return "its first beats"
    if m.moved >= MOVED_SAMPLES:
        return f"its stack moved ({m.moved} plain samples in a row unlike the hung one)"
    return None
