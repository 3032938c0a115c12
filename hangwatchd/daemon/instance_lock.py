"""One daemon per runtime dir and per state dir: an flock on DIR/private/daemon.lock in each,
held for the daemon's life.

A second daemon on the same runtime dir would rewrite daemon.json and make the
first look dead to ``status`` and ``run``; one on the same state dir (with a
runtime dir of its own) would ingest the same dump as a second incident, and
recover, heal and prune what the first is writing. The kernel drops an flock
when its holder dies, however it dies, so a crashed daemon never leaves a stale
lock.

The lock lives in a directory only the daemon's user can enter (mode 0700):
anyone who can open a file can flock it, and a user holding the lock while the
daemon restarts would keep it from starting. The runtime dir itself stays
readable by all (clients read daemon.json and status.json there).
"""

from __future__ import annotations

import errno
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
    def __init__(self, directory: Path, what: str = "runtime dir", flag: str = "--runtime-dir", says: str = "") -> None:
        """The lock of ``directory`` (``what``, chosen with ``flag``); ``says``: what the file tells a
        second daemon besides our pid (the state dir's: our runtime dir)."""
        self.directory = Path(directory)
        self.what, self.flag, self.says = what, flag, says
        self.dir = self.directory / PRIVATE_DIR
        self.path = self.dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock or raise AlreadyRunning; write our pid into the file for the next one to name.
        A disk too full to make the lock's file does not stop the daemon: returns why it is not held."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            dir_fd = self._private_dir()
            try:
                # O_NOFOLLOW: never lock (or truncate) a link's target.
                fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return f"{self.path} cannot be made ({exc.strerror}): running without the {self.what}'s lock"
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder, said = _read_holder(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            if said:
                who += f", runtime dir {said}"
            verb = "already runs with" if self.what == "runtime dir" else "already uses"
            raise AlreadyRunning(f"another daemon ({who}) {verb} {self.what} {self.directory}; "
                                 f"stop it first or pass another {self.flag}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n{self.says}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, the next daemon names no pid
        self.fd = fd
        return None

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
                               f"{self.flag}") from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise LockDirError(f"{self.dir} belongs to uid {st.st_uid}, not to the daemon's uid {os.geteuid()}; "
                               f"remove it, or pass another {self.flag}")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the file stays: unlinking it could let two daemons lock two different files
            self.fd = None


def _read_holder(fd: int) -> tuple[int | None, str]:
    """The holder's pid and what it said of itself (its runtime dir), as its file has them."""
    try:
        lines = os.pread(fd, 4096, 0).decode("utf-8", "replace").split("\n")
        return int(lines[0]), lines[1] if len(lines) > 1 else ""
    except (OSError, ValueError, IndexError):
        return None, ""
