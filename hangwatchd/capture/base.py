"""The one small interface every capture step implements."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Protocol

from ..host import procfs
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
    """Write ``data`` to a FIFO the process holds, as found by ``procfs.held_fifos``.

    Only a FIFO of the process's own user; never blocking. A full FIFO means a
    request is already pending, which is as good as ours.
    """
    fd, path, st = fifo
    if st.st_uid not in (owner, 0):
        raise StepFailed(f"{path} belongs to uid {st.st_uid}, not the process's uid {owner}; refusing to write to it")
    try:
        procfs.poke_fifo(pid, fd, data)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise StepFailed(f"nobody reads {path}") from None
        if exc.errno != errno.EAGAIN:
            raise StepFailed(f"cannot write to {path}: {exc.strerror}") from None
