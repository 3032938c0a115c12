"""One daemon per runtime dir: an flock on RUNTIME_DIR/daemon.lock, held for the daemon's life.

A second daemon on the same runtime dir would rewrite daemon.json and make the
first look dead to ``status`` and ``run``. The kernel drops an flock when its
holder dies, however it dies, so a crashed daemon never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "daemon.lock"


class AlreadyRunning(Exception):
    """Another daemon holds the lock: the message names its pid and the runtime dir."""


class InstanceLock:
    def __init__(self, runtime_dir: Path) -> None:
        self.path = Path(runtime_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise AlreadyRunning; write our pid into the file for the next one to name."""
        # O_NOFOLLOW: the runtime dir is writable by workloads; never lock (or truncate) a link's target.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise AlreadyRunning(f"another daemon ({who}) already runs with runtime dir {self.path.parent}; "
                                 "stop it first or pass another --runtime-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the file stays: unlinking it could let two daemons lock two different files
            self.fd = None


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None
