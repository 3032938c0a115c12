"""The one small interface every capture step implements, and when in a capture each runs."""

from __future__ import annotations

import enum
import errno
import os
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

from ..host import untrusted
from ..host.deadline import Deadline
from ..model import Registration


class Phase(enum.Enum):
    """When a step runs in a capture: each step says so on its own type (``Step.phase``).

    FIRST       before the incident is first stored, one after another on each rank.
    BESIDE      before the incident is first stored, beside the rank's other steps (it only
                watches over a window, or asks the driver or NCCL, never the process).
    LATE        after: started on every rank together (the moment matters across ranks),
                beside the first stage, its evidence added to the stored incident.
    DESTRUCTIVE last, after the incident is stored, only where the policy allows: it ends the process.
    """

    FIRST = "first"
    BESIDE = "beside"
    LATE = "late"
    DESTRUCTIVE = "destructive"

    @property
    def stored_first(self) -> bool:
        """In the incident as first stored (else added to it after)."""
        return self in (Phase.FIRST, Phase.BESIDE)


@runtime_checkable
class WindowStep(Protocol):
    """A step that only watches over a window (``progress``): a first look, then a second one
    ``window_by`` seconds later. Its ``run`` does both and sleeps between; a capture made in two turns
    (``daemon.make_incident.Making``) takes the first look with the other steps, gives its worker
    back while the window passes, and takes the second when it finishes the capture."""

    name: str
    phase: ClassVar[Phase]

    def window_by(self, deadline: Deadline) -> float:
        """Seconds from the first look to the second, in a capture cut at ``deadline``."""
        ...

    def open(self, target: Registration, deadline: Deadline) -> object:
        """The first look (never raises for the process's state: ``close`` says what it lacked)."""
        ...

    def close(self, target: Registration, outdir: Path, deadline: Deadline, opened: object) -> tuple[str, ...]:
        """The second look, against ``opened``; the files written (StepFailed as ``Step.run``)."""
        ...


class StepFailed(Exception):
    """The step could not do its job; the message says why, for the incident and the log."""


class StepNotApplicable(StepFailed):
    """Nothing for this step to capture here (no GPU or NVML, no NCCL process group, not started by
    ``hangwatchd run``): the incident says ``n/a`` and why, and no failure is counted."""


class Step(Protocol):
    name: str
    phase: ClassVar[Phase]

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        """Capture into ``outdir`` by ``deadline`` (the capture's, cut at this step's own timeout), and
        hand it down unchanged to every subprocess and probe; return the files written.

        Raise StepFailed with one clear line when it cannot, StepNotApplicable when it does not apply."""
        ...


def poke_held_fifo(pid: int, fifo: tuple[int, str, os.stat_result], data: bytes, owner: int | None) -> None:
    """Write ``data`` to a FIFO the process holds, as found by ``procfs.held_fifos``: only that
    very FIFO, only a FIFO of the process's own user (``untrusted.write_held_fifo``); never
    blocking. A full FIFO means a request is already pending, which is as good as ours.
    """
    fd, path, st = fifo
    if owner is None:
        raise StepFailed(f"pid {pid} has no single uid: refusing to write to {path} for it")
    try:
        untrusted.write_held_fifo(pid, fd, owner, (st.st_dev, st.st_ino), data)
    except untrusted.Refused as exc:
        raise StepFailed(f"refusing to write to {path}: {exc}") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise StepFailed(f"nobody reads {path}") from None
        if exc.errno != errno.EAGAIN:
            raise StepFailed(f"cannot write to {path}: {exc.strerror}") from None
