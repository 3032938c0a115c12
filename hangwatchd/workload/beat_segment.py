"""The beat segment: one 64-byte file a workload maps and writes, the daemon reads.

Layout (little-endian, one cache line):

    0  magic    4s   b"HWB1"
    4  version  u32  1
    8  pid      u32  the process allowed to write it
   12  (pad)
   16  count    u64  beats so far
   24  last_ns  u64  CLOCK_MONOTONIC of the last beat (system-wide, so comparable across processes)
   32  (reserved)

A beat is one ``struct.pack_into`` of (count, last_ns) into the mapping:
no system call, no lock. A torn read is harmless: the daemon only asks
"did count move?" and "how long ago was last_ns?".
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
import time
from dataclasses import dataclass

from ..host import untrusted
from ..host.atomic import write_atomic

MAGIC = b"HWB1"
VERSION = 1
SIZE = 64
_HEADER = struct.Struct("<4sII")
BEAT = struct.Struct("<QQ")

BEAT_OFFSET = 16


class SegmentError(Exception):
    pass


def create(path: str, pid: int, mode: int = 0o644) -> None:
    """Make an empty segment for ``pid`` (atomically: a reader never sees half a header)."""
    write_atomic(path, _HEADER.pack(MAGIC, VERSION, pid) + bytes(SIZE - _HEADER.size), mode)


def set_owner(path: str, pid: int) -> None:
    """Hand the segment to another pid (the launcher creates it before it knows the child's)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, struct.pack("<I", pid), 8)
    finally:
        os.close(fd)


def open_for_writing(path: str) -> tuple[mmap.mmap, itertools.count[int]]:
    """The segment's mapping and a counter that goes on from its last count."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size < SIZE:
            raise SegmentError(f"{path}: not a heartbeat segment (too small)")
        mm = mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)
    magic, version, _pid = _HEADER.unpack_from(mm, 0)
    if magic != MAGIC or version != VERSION:
        mm.close()
        raise SegmentError(f"{path}: not a heartbeat segment")
    return mm, itertools.count(BEAT.unpack_from(mm, BEAT_OFFSET)[0] + 1)


@dataclass(frozen=True)
class Reading:
    pid: int
    count: int
    last_ns: int

    def age(self, now_ns: int | None = None) -> float | None:
        """Seconds since the last beat, None before the first."""
        if self.count == 0:
            return None
        return ((now_ns if now_ns is not None else time.monotonic_ns()) - self.last_ns) / 1e9

    def wall_time(self) -> float | None:
        """The last beat as a Unix timestamp."""
        age = self.age()
        return None if age is None else time.time() - age


def read(path: str | untrusted.UserFile, uid: int | None = None) -> Reading:
    """One read of the segment; never follows a symlink, never blocks.

    The daemon reads through the ``UserFile`` the registration was resolved to
    (the beats directory's descriptor and a base name, its owner with it): a
    segment swapped for a directory, a FIFO, a symlink or another user's file
    raises ``untrusted.Refused``, which costs the registration, not a false hang;
    so does a plain path with ``uid``. A missing or malformed segment is a SegmentError.
    """
    checked = isinstance(path, untrusted.UserFile) or uid is not None
    try:
        fd = path.open_fd() if isinstance(path, untrusted.UserFile) else untrusted.open_fd(path, uid, max_size=None)
    except untrusted.Refused as exc:
        if exc.reason in ("missing", "unreadable") or not checked:
            raise SegmentError(str(exc)) from None
        raise
    try:
        data = os.pread(fd, SIZE, 0)
    except OSError as exc:
        raise SegmentError(f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) < SIZE:
        raise SegmentError(f"{path}: not a heartbeat segment (too small)")
    magic, version, pid = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise SegmentError(f"{path}: not a heartbeat segment")
    count, last_ns = BEAT.unpack_from(data, BEAT_OFFSET)
    return Reading(pid, count, last_ns)
