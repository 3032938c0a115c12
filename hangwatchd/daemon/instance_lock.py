"""One daemon per runtime dir: an flock on RUNTIME_DIR/private/daemon.lock, held for the daemon's life.

A second daemon on the same runtime dir would rewrite daemon.json and make the
first look dead to ``status`` and ``run``. The kernel drops an flock when its
holder dies, however it dies, so a crashed daemon never leaves a stale lock.

The lock lives in a directory only the daemon's user can enter (mode 0700):
anyone who can open a file can flock it, and a user holding the lock while the
daemon restarts would keep it from starting. The runtime dir itself stays
readable by all (clients read daemon.json and status.json there).
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

PRIVATE_DIR = "private"
LOCK_FILE = "daemon.lock"


class AlreadyRunning(Exception):
    """Another daemon holds the lock: the message names its pid and the runtime dir."""


class LockDirError(Exception):
    """The lock's directory is not the daemon's own: the message says what to do."""


class InstanceLock:
    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = Path(runtime_dir)
        self.dir = self.runtime_dir / PRIVATE_DIR
        self.path = self.dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise AlreadyRunning; write our pid into the file for the next one to name."""
        dir_fd = self._private_dir()
        try:
            # O_NOFOLLOW: never lock (or truncate) a link's target.
            fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise AlreadyRunning(f"another daemon ({who}) already runs with runtime dir {self.runtime_dir}; "
                                 "stop it first or pass another --runtime-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def _private_dir(self) -> int:
        """RUNTIME_DIR/private, made 0700 and ours, opened without following a link."""
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise LockDirError(f"{self.dir} is not a directory ({exc.strerror}); remove it, or pass another "
                               "--runtime-dir") from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise LockDirError(f"{self.dir} belongs to uid {st.st_uid}, not to the daemon's uid {os.geteuid()}; "
                               "remove it, or pass another --runtime-dir")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the file stays: unlinking it could let two daemons lock two different files
            self.fd = None


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None
