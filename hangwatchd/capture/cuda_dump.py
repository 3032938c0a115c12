"""Last, the CUDA coredump: write to the process's coredump pipe, wait for the dump, explain it.

The pipe is found among the FIFOs the process holds open (its default name
lies in the process's working directory), checked to belong to the process's
user, and written to without blocking. A GPU dump ends the process, so this
runs after every other step, and only when the policy allows.

Where the driver writes the dump: into the daemon's exception FIFO of the
process (``host.dump_fifos``; what ``hangwatchd run`` sets ``CUDA_COREDUMP_FILE``
to), claimed from its watcher first and read here; else into the file the
process's ``CUDA_COREDUMP_FILE`` names, watched for in its directory.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..host import dump_fifos, procfs, untrusted
from ..host.deadline import Deadline
from ..model import Registration
from ..workload import dump_names
from ..workload.runtime_files import driver_log
from . import dump_artifacts, late
from .base import Phase, StepFailed, StepNotApplicable, poke_held_fifo
from .waitfile import Watch

KEYS = frozenset({"CUDA_COREDUMP_PIPE", "CUDA_COREDUMP_FILE", "CUDA_ENABLE_USER_TRIGGERED_COREDUMP"})

# The driver loses a dump triggered while another process's dump is being taken on the same GPU:
# 8 processes on one H200, all triggered at once, lost one dump in each of four runs (the trigger
# read, the process alive, a second trigger 2 s later ignored as well). So one process at a time
# per GPU is triggered: its turn lasts until the driver has begun writing the dump file (past
# collecting the GPU's state), or TURN seconds.
TURN = 2.0
LAST_LINES = 2.0  # seconds a dump read whole from the FIFO waits for its process to end (the driver's last lines)
_turns: dict[str, threading.Lock] = {}  # one per GPU device file: bounded by the node's GPUs
_turns_guard = threading.Lock()


@contextlib.contextmanager
def turn(gpus: list[str], until: float) -> Iterator[None]:
    """Hold the turn of every GPU in ``gpus`` (in order, so two holders never wait on each other)
    until the block ends; StepFailed when one is not free by ``until`` (monotonic)."""
    held = []
    try:
        for gpu in gpus:
            with _turns_guard:
                lock = _turns.setdefault(gpu, threading.Lock())
            if not lock.acquire(timeout=max(0.0, until - time.monotonic())):
                raise StepFailed(f"other processes' GPU dumps on {gpu} took all the time this one had")
            held.append(lock)
        yield
    finally:
        for lock in reversed(held):
            lock.release()


@dataclass
class CudaDumpStep:
    driver_logs: Path | None = None  # RUNTIME_DIR/driver-logs, where hangwatchd run keeps coredump: lines
    devices: str = "/dev/nvidia"  # the GPU device files' prefix: a dump waits for its GPU's turn
    fifos: dump_fifos.ExceptionFifos | None = None  # the daemon's exception FIFOs, where it keeps them
    name: str = "cuda_dump"
    phase: ClassVar[Phase] = Phase.DESTRUCTIVE  # the dump ends the process

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        end, timeout = deadline.at, deadline.left()  # the wait, symbolising and compressing all end here
        proc = target.process
        pid = proc.pid
        if not procfs.alive(proc):
            raise StepFailed(f"pid {pid} started at {proc.start_time} is gone")
        env = procfs.environ(pid, KEYS)
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        wanted = os.path.basename(dump_names.expand(env["CUDA_COREDUMP_PIPE"], pid)) if env.get("CUDA_COREDUMP_PIPE") else None
        owner = procfs.uid(pid)
        if owner is None:
            raise StepFailed(f"pid {pid} has no single uid (setuid, or gone): refusing to act on it for its user, or to read its dump")
        pipes = [(fd, path, st) for fd, path, st in procfs.held_fifos(pid)
                 if os.path.basename(path) == wanted or os.path.basename(path).startswith(("corepipe", "cuda_pipe"))]
        if not pipes:
            raise StepNotApplicable(f"pid {pid} holds no CUDA coredump pipe: not started by hangwatchd run "
                                    "(no CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1), or CUDA not initialised")
        if self.fifos is not None and self.fifos.on and env.get("CUDA_COREDUMP_FILE"):
            mine = self.fifos.path_for(target)
            if env["CUDA_COREDUMP_FILE"].replace("%p", str(dump_fifos.own_pid(pid))) == str(mine):
                stored = self._from_fifo(target, pipes[0], owner, outdir, deadline)
                return self._kept(stored, pid, owner, outdir)
        pattern = env.get("CUDA_COREDUMP_FILE") or f"core_%t_{socket.gethostname()}_%p.nvcudmp"
        target_glob = Path(dump_names.expand(pattern, pid))
        if not target_glob.is_absolute():
            target_glob = cwd / target_glob
        # The dump's directory is the workload's choice: held as a descriptor from here on.
        watch = Watch(target_glob.parent, target_glob.name, owner)
        try:
            gone = lambda: not procfs.alive(proc)  # noqa: E731 - a closure named where it is used
            with turn(procfs.gpu_device_files(pid, self.devices), end):
                poke_held_fifo(pid, pipes[0], b"\0", owner)
                watch.begun(min(TURN, max(0.0, end - time.monotonic())), gone)
            found = watch.wait(max(0.0, end - time.monotonic()), gone)
            if found is None:
                partial = watch.new_files()
                if partial:
                    size = watch.lstat(partial[0]).st_size
                    raise StepFailed(f"the driver wrote {size} bytes of {partial[0]} and did not finish within {timeout:g} s")
                raise StepFailed(f"no dump appeared as {target_glob} within {timeout:g} s")
            try:
                fd = watch.open(found, owner, dump_artifacts.MAX_DUMP)
            except untrusted.Refused as exc:
                raise StepFailed(f"refusing to read the dump: {exc}") from None
            try:
                # symbolized.json goes into the stored incident before the dump is compressed (capture.late).
                stored = dump_artifacts.store_fd(fd, found, outdir, remove_source=False,
                                                 on_symbolized=lambda: late.publish(outdir), deadline=end)
                if "coredump.nvcudmp.zst" in stored.files:  # kept: the workload's copy goes
                    watch.unlink_same(found, os.fstat(fd))
            finally:
                os.close(fd)
        finally:
            watch.close()
        return self._kept(stored, pid, owner, outdir)

    def _kept(self, stored: dump_artifacts.Stored, pid: int, owner: int, outdir: Path) -> tuple[str, ...]:
        """The files a dump became, with the driver's lines; StepFailed where nothing was kept."""
        files = list(stored.files)
        if self.driver_logs is not None and dump_artifacts.copy_text(driver_log(self.driver_logs, owner, pid), outdir / "driver.log", owner):
            files.append("driver.log")
        if not stored.files:
            raise StepFailed(stored.note or "the dump could not be kept")
        if stored.note:
            (outdir / "cuda_dump-notes.txt").write_text(stored.note + "\n")
            files.append("cuda_dump-notes.txt")
        return tuple(files)

    def _from_fifo(self, target: Registration, pipe: tuple[int, str, os.stat_result], owner: int, outdir: Path,
                   deadline: Deadline) -> dump_artifacts.Stored:
        """The dump through the daemon's FIFO of the process: claimed from its watcher (so it is not
        taken for an exception of the process's own), triggered, read here until whole or the deadline."""
        assert self.fifos is not None
        end, timeout = deadline.at, deadline.left()
        proc = target.process
        gone = lambda: not procfs.alive(proc)  # noqa: E731 - a closure named where it is used
        try:
            fd, fifo = self.fifos.claim(target)
        except OSError as exc:
            raise StepFailed(f"the dump's FIFO of pid {proc.pid} cannot be had: {exc.strerror or exc}") from None
        raw = outdir / "coredump.nvcudmp"
        out = os.open(raw, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        drain = dump_fifos.Drain(out, self.fifos.cap)
        try:
            with turn(procfs.gpu_device_files(proc.pid, self.devices), end):
                poke_held_fifo(proc.pid, pipe, b"\0", owner)
                begun_by = min(end, time.monotonic() + TURN)
                while not drain.size and time.monotonic() < begun_by and not gone():
                    dump_fifos.wait_readable(fd, 0.05)
                    drain.feed(fd, budget=dump_fifos.HEADER)
            by = min(end, time.monotonic() + TURN)
            while drain.size < dump_fifos.HEADER and drain.ended is None and time.monotonic() < by and not gone():
                dump_fifos.wait_readable(fd, 0.05)
                drain.feed(fd, budget=dump_fifos.HEADER)
            if drain.size >= dump_fifos.HEADER:
                drain.expect(os.pread(out, dump_fifos.HEADER, 0))
            note = dump_fifos.read_blocking(fd, drain, end, fifo, gone) if drain.size else None
            # The driver's last lines ("All done") come as it closes and ends the process: a moment for them.
            last_lines_by = min(end, time.monotonic() + LAST_LINES)
            while drain.ended == "whole" and not gone() and time.monotonic() < last_lines_by:
                time.sleep(0.05)
        finally:
            os.close(fd)
            os.close(out)
            self.fifos.release(proc)
        if drain.size == 0:
            raw.unlink(missing_ok=True)
            raise StepFailed(f"no dump appeared in {fifo} within {timeout:g} s")
        if drain.ended != "whole":
            raw.unlink(missing_ok=True)
            raise StepFailed(f"the driver wrote {drain.size} bytes into {fifo} and did not finish within {timeout:g} s"
                             + (f" ({note})" if note and drain.ended != "short" else ""))
        fd = os.open(raw, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        raw.unlink()  # read through fd from here: the symbolised report is published with outdir, never the raw dump
        try:
            return dump_artifacts.store_fd(fd, raw, outdir, remove_source=False, on_symbolized=lambda: late.publish(outdir),
                                           deadline=end)
        except untrusted.Refused as exc:
            raise StepFailed(f"refusing to read the dump: {exc}") from None
        finally:
            os.close(fd)
