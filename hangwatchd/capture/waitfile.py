"""Waiting, with a deadline, for a file that another process is writing to be complete.

A file counts as complete when its writer closes it (inotify CLOSE_WRITE) or
moves it into place (MOVED_TO), or when ``finished()`` says the writer is gone.
A file still being written is never handed out early.

The directory is the workload's choice (its CUDA_COREDUMP_FILE, its flight
recorder's temp file), so it is resolved once, when the watch starts, to a
descriptor: the listing, the inotify watch, the open of what was found and its
removal all go through that descriptor and a base name, never through the path
again (a directory on the way swapped for a link later leads nowhere else).
"""

from __future__ import annotations

import fnmatch
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from inotify_simple import INotify
from inotify_simple import flags as inflags

from ..host import untrusted


class Watch:
    """Start watching before you trigger the writer, so no close is missed."""

    def __init__(self, directory: Path, pattern: str, owner: int | None = None) -> None:
        self.directory = directory
        self.pattern = pattern
        self.owner = owner  # only files of this uid count: the dir may be shared with other users
        self.dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.before = set(self._matching())
            self.inotify = INotify()
            self.inotify.add_watch(untrusted.fd_path(self.dir_fd), inflags.CREATE | inflags.CLOSE_WRITE | inflags.MOVED_TO)
            self.closed: list[str] = []  # complete files seen while waiting for a start (``begun``)
        except BaseException:
            os.close(self.dir_fd)
            raise

    def close(self) -> None:
        self.inotify.close()
        os.close(self.dir_fd)

    def _matching(self) -> list[str]:
        return [n for n in os.listdir(self.dir_fd) if fnmatch.fnmatch(n, self.pattern)]

    def new_files(self) -> list[Path]:
        return sorted(self.directory / n for n in self._matching() if n not in self.before and self._ours(n))

    def _ours(self, name: str) -> bool:
        """A regular file of the owner: another user's file (or FIFO, or link) planted under the
        expected name is passed over, so it can neither stand in for the real one nor hide it."""
        if self.owner is None:
            return True
        try:
            st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == self.owner

    def open(self, found: Path, uid: int | None, max_size: int | None = None) -> int:
        """A checked fd of a file this watch found (``untrusted.open_fd``, in the watched
        directory's descriptor): root's own files only for root's processes."""
        return untrusted.open_fd(found.name, uid, allow_root=uid == 0, max_size=max_size, dir_fd=self.dir_fd)

    def lstat(self, found: Path) -> os.stat_result:
        return os.stat(found.name, dir_fd=self.dir_fd, follow_symlinks=False)

    def unlink_same(self, found: Path, st: os.stat_result) -> bool:
        """Remove a found file only while its name still holds the file read (same inode)."""
        try:
            now = os.stat(found.name, dir_fd=self.dir_fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return False
            os.unlink(found.name, dir_fd=self.dir_fd)
            return True
        except OSError:
            return False

    def _events(self, timeout: float) -> list[tuple[str, bool]]:
        """(name, complete) of each matching file of the owner created, closed after writing or
        moved in within ``timeout``: complete is False for a file only created."""
        out = []
        for event in self.inotify.read(timeout=int(timeout * 1000)):
            if event.name and fnmatch.fnmatch(event.name, self.pattern) and self._ours(event.name):
                out.append((event.name, bool(event.mask & (inflags.CLOSE_WRITE | inflags.MOVED_TO))))
        return out

    def begun(self, timeout: float, finished: Callable[[], bool] = lambda: False) -> bool:
        """Whether a new file was started (created, or already complete) within ``timeout``; False
        at once when ``finished()``. What completes meanwhile is kept for ``wait``."""
        end = time.monotonic() + timeout
        while not self.closed:
            left = end - time.monotonic()
            if left <= 0 or finished():
                return False
            events = self._events(min(left, 0.1))
            self.closed += [name for name, complete in events if complete]
            if events:
                return True
        return True

    def wait(self, timeout: float, finished: Callable[[], bool] = lambda: False) -> Path | None:
        """The first new complete file; None at the deadline, or as soon as ``finished()`` (the
        process that was to write it is gone) with nothing new there: nothing more can come."""
        if self.closed:
            return self.directory / self.closed[0]
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            # Any close after the watch began is a new write, even to a name seen before.
            complete = [name for name, done in self._events(min(left, 0.5)) if done]
            if complete:
                return self.directory / complete[0]
            if finished():
                fresh = self.new_files()
                return fresh[0] if fresh else None
