"""Dumps nobody saw arrive: a look at the dump dir at start and after an inotify overflow.

inotify only reports what happens while the daemon watches. A dump written
while the daemon was down, or whose event was lost in an overflow, is found
by listing the dir; one still changing may be half-written, and is left for
its own CLOSE_WRITE or the next look.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

QUIET_S = 2.0  # a dump unchanged this long is whole (the driver writes it in one go)


@dataclass(frozen=True)
class Scan:
    ready: tuple[str, ...]  # names to ingest now
    busy: bool  # some are still changing: look again in QUIET_S


def scan(directory: Path, ingested: set[str], now: float | None = None) -> Scan:
    """The names in ``directory`` not yet ingested, split into whole and maybe still being written.

    OSError when the directory cannot be listed."""
    now = time.time() if now is None else now
    ready, busy = [], False
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or path.name in ingested:
            continue
        try:
            quiet = now - path.lstat().st_mtime >= QUIET_S
        except OSError:
            continue  # gone already
        if quiet:
            ready.append(path.name)
        else:
            busy = True
    return Scan(tuple(ready), busy)
