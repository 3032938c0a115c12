"""Waiting, with a deadline, for a file that another process is writing to be complete.

A file counts as complete when its writer closes it (inotify CLOSE_WRITE) or
moves it into place (MOVED_TO), or when ``finished()`` says the writer is gone.
A file still being written is never handed out early.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable
from pathlib import Path

from inotify_simple import INotify
from inotify_simple import flags as inflags


class Watch:
    """Start watching before you trigger the writer, so no close is missed."""

    def __init__(self, directory: Path, pattern: str) -> None:
        self.directory = directory
        self.pattern = pattern
        self.before = {p.name for p in directory.glob(pattern)}
        self.inotify = INotify()
        self.inotify.add_watch(directory, inflags.CLOSE_WRITE | inflags.MOVED_TO)

    def close(self) -> None:
        self.inotify.close()

    def new_files(self) -> list[Path]:
        return sorted(p for p in self.directory.glob(self.pattern) if p.name not in self.before)

    def wait(self, timeout: float, finished: Callable[[], bool] = lambda: False) -> Path | None:
        """The first new complete file, or None at the deadline."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            for event in self.inotify.read(timeout=int(min(left, 0.5) * 1000)):
                # Any close after the watch began is a new write, even to a name seen before.
                if event.name and fnmatch.fnmatch(event.name, self.pattern):
                    return self.directory / event.name
            if finished():
                fresh = self.new_files()
                if fresh:
                    return fresh[0]
