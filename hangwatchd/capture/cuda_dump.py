"""Last, the CUDA coredump: write to the process's coredump pipe, wait for the dump, explain it.

The pipe is found among the FIFOs the process holds open (its default name
lies in the process's working directory), checked to belong to the process's
user, and written to without blocking. A GPU dump ends the process, so this
runs after every other step, and only when the policy allows.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..host import procfs, untrusted
from ..model import Registration
from ..workload import dump_names
from . import dump_artifacts, late
from .base import StepFailed, StepNotApplicable, poke_held_fifo
from .waitfile import Watch

KEYS = frozenset({"CUDA_COREDUMP_PIPE", "CUDA_COREDUMP_FILE", "CUDA_ENABLE_USER_TRIGGERED_COREDUMP"})


@dataclass
class CudaDumpStep:
    driver_logs: Path | None = None  # RUNTIME_DIR/driver-logs, where hangwatchd run keeps coredump: lines
    name: str = "cuda_dump"
    destructive: bool = True  # the dump ends the process

    def run(self, target: Registration, outdir: Path, timeout: float) -> tuple[str, ...]:
        end = time.monotonic() + timeout  # the wait, symbolising and compressing all end here
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
        pattern = env.get("CUDA_COREDUMP_FILE") or f"core_%t_{socket.gethostname()}_%p.nvcudmp"
        target_glob = Path(dump_names.expand(pattern, pid))
        if not target_glob.is_absolute():
            target_glob = cwd / target_glob
        # The dump's directory is the workload's choice: held as a descriptor from here on.
        watch = Watch(target_glob.parent, target_glob.name, owner)
        try:
            poke_held_fifo(pid, pipes[0], b"\0", owner)
            found = watch.wait(max(0.0, end - time.monotonic()), lambda: not procfs.alive(proc))
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
        files = list(stored.files)
        if self.driver_logs is not None and dump_artifacts.copy_text(self.driver_logs / f"{pid}.log", outdir / "driver.log", owner):
            files.append("driver.log")
        if not stored.files:
            raise StepFailed(stored.note or "the dump could not be kept")
        if stored.note:
            (outdir / "cuda_dump-notes.txt").write_text(stored.note + "\n")
            files.append("cuda_dump-notes.txt")
        return tuple(files)
