"""Ranks below a launcher: ``hangwatchd run -- torchrun ...`` registers torchrun, each rank registers itself.

A rank's registration names the launched process above it (``launcher``, the
pid its inherited beat segment was made for). That process is then known to be
a launcher: watched for its exit, never for beats, and never a job-mate in an
incident. Only a process of the same user that has not beaten itself is taken
for one: a user cannot switch off the watching of another user's process, nor
of a workload that beats and also starts helpers that beat.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..host import procfs, untrusted
from ..model import ProcessId, Registration
from ..workload import beat_segment
from .watched import Watched


def launched_above(r: Registration) -> ProcessId | None:
    """The process ``hangwatchd run`` launched above rank ``r``, as its registration names it: only
    a process of the same user that ``r`` runs below (a registration may name any pid)."""
    if r.launcher is None:
        return None
    above = procfs.identify(r.launcher)
    if above is None or procfs.uid(above.pid) != r.uid or not procfs.descends_from(r.process.pid, above):
        return None
    return above


def launcher_of(rank: Watched, watched: Iterable[Watched]) -> Watched | None:
    """The watched process ``rank`` runs below, when it may be taken for a launcher."""
    pid = rank.registration.launcher
    if pid is None:
        return None
    for w in watched:
        if w.process.pid == pid and w is not rank and w.registration.uid == rank.registration.uid and not _has_beaten(w):
            return w
    return None


def ranks_below(launcher: Watched, watched: Iterable[Watched]) -> bool:
    """Did a rank below ``launcher`` register before the launcher's own registration was read?"""
    return not _has_beaten(launcher) and any(
        w.registration.launcher == launcher.process.pid and w.registration.uid == launcher.registration.uid
        for w in watched if w is not launcher)


def _has_beaten(w: Watched) -> bool:
    if w.beat is not None and w.beat.count:
        return True
    if w.registration.beat_at:
        try:
            return beat_segment.read(w.registration.beat_at).count > 0
        except (beat_segment.SegmentError, untrusted.Refused):
            return False
    return False
