"""What the store holds on disk, from one walk: each incident's bytes and raw GPU dumps, and
what a capture is writing now.

Only what the store owns is counted: its incidents (root's directories), the drafts and
late evidence beside them, and its index, by the blocks they use (allocated, not apparent:
a sparse file costs what it uses). Never the state dir as a whole: the dump dir is any
user's to write, and a sparse 60 GiB file there must not make retention delete anyone's
incidents. Links are never followed.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from .store import LATE_DIR, Store, late_owner

DUMP_PREFIX = "coredump.nvcudmp"  # PID/coredump.nvcudmp(.zst|.xz|.gz): a raw GPU dump, the bulk of an incident


class Stopped(Exception):
    """The walk was asked to stop before it was done."""


@dataclass(frozen=True)
class Held:
    """One incident directory: its bytes, and its raw GPU dumps (path, bytes) among them."""

    id: str
    bytes: int
    dumps: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Footprint:
    incidents: dict[str, Held] = field(default_factory=dict)  # by id: directories named like an incident
    busy: frozenset[str] = frozenset()  # incidents a capture still writes beside (late evidence)
    total: int = 0  # every byte the store owns: index, incidents, drafts, late evidence, leftovers


def allocated(path: str) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0  # gone meanwhile


def tree(path: str, stop: threading.Event | None = None) -> Held:
    """The bytes of everything under ``path`` (an incident or another entry of the store's
    directory), and the raw dumps one level down. Stopped when ``stop`` is set."""
    total, dumps = 0, []
    pending = [(path, 0)]
    while pending:
        if stop is not None and stop.is_set():
            raise Stopped
        where, depth = pending.pop()
        try:
            entries = os.scandir(where)
        except NotADirectoryError:
            total += allocated(where)
            continue
        except OSError:
            continue  # gone meanwhile, or not ours to read
        with entries:
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        pending.append((e.path, depth + 1))
                        continue
                    size = e.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
                total += size
                if depth == 1 and e.name.startswith(DUMP_PREFIX):
                    dumps.append((e.path, size))
    return Held(os.path.basename(path), total, tuple(dumps))


def measure(store: Store, stop: threading.Event | None = None) -> Footprint:
    """One walk of the store's directory, every file stat'ed once. Stopped when ``stop`` is set."""
    incidents: dict[str, Held] = {}
    busy: set[str] = set()
    total = allocated(str(store.index)) + allocated(str(store.index) + "-wal")
    try:
        entries = os.scandir(store.dir)
    except FileNotFoundError:
        return Footprint(total=total)
    with entries:
        for e in entries:
            held = tree(e.path, stop)
            total += held.bytes
            if e.name.startswith(LATE_DIR):
                busy.add(late_owner(e.name))
            elif not e.name.startswith(".") and e.is_dir(follow_symlinks=False):
                incidents[e.name] = held
    return Footprint(incidents, frozenset(busy), total)
