"""PyTorch's flight recorder: ask the process to dump its NCCL trace, keep it as flight-recorder.pkl.

PyTorch (TORCH_NCCL_DEBUG_INFO_PIPE_FILE set) holds open a FIFO named
PREFIX + rank + ".pipe" and, when something is written to it, writes its
trace to TORCH_NCCL_DEBUG_INFO_TEMP_FILE + rank. We write only to a FIFO that
very process holds open for reading, owned by its user.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..host import procfs, untrusted
from ..host.deadline import Deadline
from ..model import Registration
from .base import Phase, StepFailed, StepNotApplicable, poke_held_fifo
from .waitfile import Watch

MAX_TRACE = 256 << 20  # bytes: a flight recorder trace is a few MB
KEYS = frozenset({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", "RANK"})


@dataclass(frozen=True)
class Pipe:
    """A process's flight-recorder pipe, as it holds it, and where its trace will be written."""

    fifo: tuple[int, str, os.stat_result]  # (fd in the process, path, stat), as procfs.held_fifos gives
    owner: int  # the process's one uid: the only user whose trace we read
    trace: Path


class NoPipe(StepNotApplicable):
    """The process holds no flight-recorder pipe (yet): no NCCL process group, or PyTorch < 2.3."""


def find_pipe(target: Registration) -> Pipe:
    """The pipe the process holds. Raises NoPipe while it holds none, StepNotApplicable for a
    process not started by ``hangwatchd run``, StepFailed for one with no single uid."""
    pid = target.process.pid
    env = procfs.environ(pid, KEYS)
    # PyTorch 2.11 writes to TORCH_FR_DUMP_TEMP_FILE; older ones to TORCH_NCCL_DEBUG_INFO_TEMP_FILE.
    prefix = env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    temp = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not prefix or not temp:
        raise StepNotApplicable("the process has no TORCH_NCCL_DEBUG_INFO_PIPE_FILE and TORCH_FR_DUMP_TEMP_FILE "
                                "(or TORCH_NCCL_DEBUG_INFO_TEMP_FILE): not started by hangwatchd run")
    rank = env.get("RANK", str(target.rank) if target.rank is not None else "0")
    pipe_name = os.path.basename(prefix) + rank + ".pipe"
    owner = procfs.uid(pid)
    if owner is None:
        raise StepFailed(f"pid {pid} has no single uid (setuid, or gone): refusing to act on it for its user, or to read its trace")
    fifo = next(((fd, path, st) for fd, path, st in procfs.held_fifos(pid) if os.path.basename(path) == pipe_name), None)
    if fifo is None:
        raise NoPipe(f"pid {pid} holds no flight-recorder pipe {pipe_name}: no NCCL process group (or PyTorch < 2.3)")
    trace = Path(temp + rank)
    if not trace.is_absolute():
        trace = Path(os.readlink(f"/proc/{pid}/cwd")) / trace
    return Pipe(fifo, owner, trace)


@contextlib.contextmanager
def request_trace(pid: int, pipe: Pipe, timeout: float, finished: Callable[[], bool]) -> Iterator[tuple[Watch, Path | None]]:
    """Ask the process for its trace: the watch over the trace's directory (the workload's choice,
    held as a descriptor from here on) and the trace written after the request, or None (at
    ``timeout``, or as soon as ``finished()``)."""
    watch = Watch(pipe.trace.parent, pipe.trace.name, pipe.owner)
    try:
        poke_held_fifo(pid, pipe.fifo, b"1", pipe.owner)
        yield watch, watch.wait(timeout, finished)
    finally:
        watch.close()


@dataclass
class FlightRecorderStep:
    name: str = "flight_recorder"
    phase: ClassVar[Phase] = Phase.LATE  # every rank's recorder asked at once, its trace added after the incident is stored

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        pid = target.process.pid
        pipe = find_pipe(target)
        end, timeout = deadline.at, deadline.left()
        with request_trace(pid, pipe, timeout, lambda: not procfs.alive(target.process)) as (watch, found):
            if found is None:
                if time.monotonic() < end:  # the wait ended early: the process was gone
                    raise StepFailed(f"pid {pid} ended (its GPU dump, a crash) before its flight recorder wrote {pipe.trace}")
                raise StepFailed(f"the flight recorder wrote nothing to {pipe.trace} within {timeout:g} s")
            try:
                fd = watch.open(found, pipe.owner, MAX_TRACE)
                try:
                    untrusted.copy_fd(fd, found, outdir / "flight-recorder.pkl", MAX_TRACE, max(1.0, timeout))
                finally:
                    os.close(fd)
            except untrusted.Refused as exc:
                raise StepFailed(f"refusing to read the trace: {exc}") from None
        return ("flight-recorder.pkl",)
