"""Waiting, with a deadline, for a file that another process is writing to be complete.

A file counts as complete when its writer closes it (inotify CLOSE_WRITE) or
moves it into place (MOVED_TO), or when ``finished()`` says the writer is gone.
A file still being written is never handed out early.
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


class Watch:
    """Start watching before you trigger the writer, so no close is missed."""

    def __init__(self, directory: Path, pattern: str, owner: int | None = None) -> None:
        self.directory = directory
        self.pattern = pattern
        self.owner = owner  # only files of this uid count: the dir may be shared with other users
        self.before = {p.name for p in directory.glob(pattern)}
        self.inotify = INotify()
        self.inotify.add_watch(directory, inflags.CLOSE_WRITE | inflags.MOVED_TO)

    def close(self) -> None:
        self.inotify.close()

    def new_files(self) -> list[Path]:
        return sorted(p for p in self.directory.glob(self.pattern) if p.name not in self.before and self._ours(p))

    def _ours(self, path: Path) -> bool:
        """A regular file of the owner: another user's file (or FIFO, or link) planted under the
        expected name is passed over, so it can neither stand in for the real one nor hide it."""
        if self.owner is None:
            return True
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == self.owner

    def wait(self, timeout: float, finished: Callable[[], bool] = lambda: False) -> Path | None:
        """The first new complete file, or None at the deadline."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            for event in self.inotify.read(timeout=int(min(left, 0.5) * 1000)):
                # Any close after the watch began is a new write, even to a name seen before.
                if event.name and fnmatch.fnmatch(event.name, self.pattern) and self._ours(self.directory / event.name):
                    return self.directory / event.name
            if finished():
                fresh = self.new_files()
                if fresh:
                    return fresh[0]
