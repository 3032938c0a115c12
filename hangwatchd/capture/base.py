"""The one small interface every capture step implements."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Protocol

from ..host import untrusted
from ..model import Registration


class StepFailed(Exception):
    """The step could not do its job; the message says why, for the incident and the log."""


class StepNotApplicable(StepFailed):
    """Nothing for this step to capture here (no GPU or NVML, no NCCL process group, not started by
    ``hangwatchd run``): the incident says ``n/a`` and why, and no failure is counted."""


class Step(Protocol):
    name: str  # a step may also set ``destructive = True``: it runs last, and only when policy allows

    def run(self, target: Registration, outdir: Path, timeout: float) -> tuple[str, ...]:
        """Capture into ``outdir`` within ``timeout`` seconds; return the files written.

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
