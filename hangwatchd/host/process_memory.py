"""A few bytes of a process's memory (the path it passes to open, the descriptors it passes to
poll), read only where the read cannot be made to wait on whoever owns the process.

Reading ``/proc/PID/mem`` faults the page in for us. A page its owner backs with a file they serve
(a FUSE mount of theirs) or with userfaultfd would make that fault, and the daemon's thread, wait
on them. So only private anonymous memory is read (the heap, the stack, unnamed mappings: the
kernel fills those itself), never more than ``MAX_READ`` bytes, never past the end of the mapping,
and not at all where an ordinary user may handle the kernel's own faults with userfaultfd
(``vm.unprivileged_userfaultfd = 1``). The process may remap the address between our look at its
maps and the read, so the read itself also runs on a thread of its own with a deadline; a read
that never returns is left behind (its thread is a daemon thread), and after ``MAX_STUCK`` of
those no more are tried.
"""

from __future__ import annotations

import os
import threading

from .procfs import PROC

MAX_READ = 4096
MAX_MAPS = 8 << 20  # bytes of /proc/PID/maps looked through for the address
MAX_STUCK = 4
READ_TIMEOUT = 0.5

_stuck = 0
_stuck_lock = threading.Lock()


def _uffd_open_to_users() -> bool:
    try:
        with open("/proc/sys/vm/unprivileged_userfaultfd", "rb") as f:
            return f.read(8).strip() == b"1"
    except OSError:
        return False  # a kernel without userfaultfd


def anonymous_span(pid: int, addr: int) -> int | None:
    """Bytes readable from ``addr`` to the end of the private anonymous mapping that holds it;
    None when no such mapping holds it (a file's, a shared one, none at all)."""
    try:
        f = open(PROC / str(pid) / "maps", "rb")
    except OSError:
        return None
    with f:
        seen = 0
        for line in f:
            seen += len(line)
            if seen > MAX_MAPS:
                return None
            cols = line.split(None, 5)
            if len(cols) < 5:
                continue
            lo, _, hi = cols[0].partition(b"-")
            try:
                start, end = int(lo, 16), int(hi, 16)
            except ValueError:
                continue
            if addr >= end:
                continue
            if addr < start:
                return None  # maps are sorted: nothing holds it
            perms, inode = cols[1], cols[4]
            name = cols[5].strip() if len(cols) > 5 else b""
            anonymous = inode == b"0" and (not name or name in (b"[heap]", b"[stack]") or name.startswith(b"[anon:"))
            if not anonymous or perms[:1] != b"r" or perms[3:4] != b"p":
                return None
            return end - addr
    return None


def read(pid: int, addr: int, size: int, owner_uid: int | None) -> bytes | None:
    """At most ``size`` (capped at ``MAX_READ``) bytes of ``pid``'s memory at ``addr``, where that
    is safe (see the module's text); None where it is not, or the read failed."""
    global _stuck
    if addr <= 0 or size <= 0:
        return None
    if owner_uid != 0 and _uffd_open_to_users():
        return None
    span = anonymous_span(pid, addr)
    if span is None:
        return None
    size = min(size, MAX_READ, span)
    with _stuck_lock:
        if _stuck >= MAX_STUCK:
            return None
    result: list[bytes | None] = [None]

    def work() -> None:
        try:
            fd = os.open(PROC / str(pid) / "mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            result[0] = os.pread(fd, size, addr)
        except OSError:
            pass
        finally:
            os.close(fd)

    t = threading.Thread(target=work, name="hangwatchd-memread", daemon=True)
    t.start()
    t.join(READ_TIMEOUT)
    if t.is_alive():
        with _stuck_lock:
            _stuck += 1
        return None
    return result[0]


def read_string(pid: int, addr: int, owner_uid: int | None) -> str | None:
    """A NUL-terminated string at ``addr`` (at most ``MAX_READ`` bytes), as text; None where it
    cannot be read safely or has no end within the bytes read."""
    raw = read(pid, addr, MAX_READ, owner_uid)
    if raw is None:
        return None
    end = raw.find(b"\0")
    if end < 0:
        return None
    return raw[:end].decode("utf-8", "surrogateescape")
