"""The trust boundary: every file under the runtime dir and the dump dir is read through here.

Those directories are world-writable (sticky, like /tmp): any local user can put
anything there, under any name, and swap it while we look. The daemon is root
with ptrace, so one careless ``open`` lets a user read any file (a symlink),
stall the daemon (a FIFO), crash it (a directory) or file evidence against
another user's job (a file of theirs, named for someone else's pid). Here:

- a file is opened once, with ``O_NOFOLLOW | O_NONBLOCK`` (never a link, never a
  wait for a FIFO's writer), and every later check and read uses that descriptor,
  so nothing can be swapped in between;
- ``fstat`` of that descriptor decides: the expected type (a regular file, or a
  FIFO where one is expected), the owner (the uid the claimed process runs as,
  root's own files where allowed), one link only (a hard link of someone else's
  file is refused), and a size cap;
- reads are bounded in bytes and in time;
- a process's uid counts only when its real, effective, saved and filesystem
  uids are all one: a setuid program started by a user is never acted on for
  that user.

Refusals raise ``Refused``: ``reason`` is a metric label, the message the log line.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

READ_CHUNK = 1 << 20


class Refused(Exception):
    """A file or process we will not act on; ``reason`` is a short label, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def process_uid(pid: int) -> int:
    """The one uid a process runs as, from /proc/PID/status; Refused when there is not one.

    ``Uid:`` lists real, effective, saved and filesystem uids. A setuid program
    (``passwd``: real 1000, effective 0) runs with someone else's rights: no user
    may make root ptrace it, so it has no single owner and is refused.
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read(64 * 1024)
    except OSError:
        raise Refused("no_process", f"pid {pid} is not running") from None
    for line in text.splitlines():
        if line.startswith(b"Uid:"):
            try:
                uids = {int(x) for x in line.split()[1:5]}
            except ValueError:
                break
            if len(uids) != 1:
                raise Refused("setuid", f"pid {pid} runs with mixed uids ({line[4:].decode().split()}: "
                                        "real, effective, saved, fs); a setuid process is never acted on for a user")
            return uids.pop()
    raise Refused("no_process", f"pid {pid}: no Uid line in /proc/{pid}/status")


def describe(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def check(st: os.stat_result, path: str | os.PathLike[str], uid: int | None, *, fifo: bool = False,
          allow_root: bool = True, max_size: int | None = None) -> None:
    """Refuse ``st`` unless it is what we expect: type, owner ``uid``, one link, at most ``max_size``.

    ``uid`` None accepts any owner (the caller then files the content as the owner's).
    Root's own files are accepted where ``allow_root``: only root can make them.
    """
    wanted = stat.S_ISFIFO if fifo else stat.S_ISREG
    if not wanted(st.st_mode):
        raise Refused("not_fifo" if fifo else "not_regular",
                      f"{path} is {describe(st)}, not {'a FIFO' if fifo else 'a regular file'}")
    if uid is not None and st.st_uid != uid and not (allow_root and st.st_uid == 0):
        raise Refused("wrong_owner", f"{path} belongs to uid {st.st_uid}, not uid {uid} that the process runs as")
    if not fifo and st.st_nlink != 1 and st.st_uid != uid:
        # A hard link of a file its owner never put here (protected_hardlinks off).
        raise Refused("hard_link", f"{path} has {st.st_nlink} links and belongs to uid {st.st_uid}")
    if max_size is not None and not fifo and st.st_size > max_size:
        raise Refused("too_big", f"{path} is {st.st_size} bytes, more than the {max_size} allowed")


def open_fd(path: str | os.PathLike[str], uid: int | None, *, fifo: bool = False, allow_root: bool = True,
            max_size: int | None = None, dir_fd: int | None = None, write: bool = False) -> int:
    """An fd of ``path`` (relative to ``dir_fd`` if given) that passed ``check``; Refused otherwise.

    Never follows a symlink at the last component, never blocks (a FIFO with no
    writer opens at once), and the checks are of the opened object itself.
    """
    flags = (os.O_WRONLY if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused("symlink", f"{path} is a symlink; symlinks are refused") from None
        if exc.errno == errno.ENOENT:
            raise Refused("missing", f"{path} does not exist") from None
        if exc.errno == errno.ENXIO:
            raise Refused("not_regular", f"{path} is a FIFO or socket nobody serves") from None
        raise Refused("unreadable", f"{path}: cannot open ({exc.strerror})") from None
    try:
        check(os.fstat(fd), path, uid, fifo=fifo, allow_root=allow_root, max_size=max_size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, path: str | os.PathLike[str], max_size: int, deadline: float) -> bytes:
    """Up to ``max_size`` bytes from an fd opened by ``open_fd``, within ``deadline`` seconds."""
    end = time.monotonic() + deadline
    parts: list[bytes] = []
    total = 0
    while True:
        if time.monotonic() > end:
            raise Refused("slow", f"{path}: not read within {deadline:g} s")
        try:
            chunk = os.pread(fd, min(READ_CHUNK, max_size + 1 - total), total)
        except BlockingIOError:
            raise Refused("not_regular", f"{path}: would block") from None
        except OSError as exc:
            raise Refused("unreadable", f"{path}: {exc.strerror}") from None
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        total += len(chunk)
        if total > max_size:
            raise Refused("too_big", f"{path} grew past the {max_size} bytes allowed")


def read_bytes(path: str | os.PathLike[str], uid: int | None, max_size: int, deadline: float = 5.0, *,
               allow_root: bool = True, dir_fd: int | None = None) -> bytes:
    """The whole of a small untrusted regular file: checked, capped, with a deadline."""
    fd = open_fd(path, uid, allow_root=allow_root, max_size=max_size, dir_fd=dir_fd)
    try:
        return read_fd(fd, path, max_size, deadline)
    finally:
        os.close(fd)


def owner_of(path: str | os.PathLike[str], max_size: int | None = None) -> int:
    """The uid owning a regular file (no links followed); Refused for anything else."""
    fd = open_fd(path, None, max_size=max_size)
    try:
        return os.fstat(fd).st_uid
    finally:
        os.close(fd)


@contextmanager
def opened(path: str | os.PathLike[str], uid: int | None, max_size: int | None = None,
           allow_root: bool = True) -> Iterator[tuple[int, os.stat_result]]:
    """``with opened(p, uid) as (fd, st)``: the checked fd and its stat, closed after."""
    fd = open_fd(path, uid, allow_root=allow_root, max_size=max_size)
    try:
        yield fd, os.fstat(fd)
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    """A path that reopens exactly this open file, also for a child process (which cannot use
    its own /proc/self for our fds): readers that take a path get the checked file, not a name
    that could be swapped since."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def copy_fd(fd: int, src: str | os.PathLike[str], dst: Path, max_size: int, deadline: float) -> int:
    """Copy an fd opened by ``open_fd`` into a new ``dst`` (mode 0600, never through a link);
    return the bytes copied. The incident's permissions are set when it is committed."""
    end = time.monotonic() + deadline
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    total = 0
    try:
        while True:
            if time.monotonic() > end:
                raise Refused("slow", f"{src}: not copied within {deadline:g} s")
            chunk = os.pread(fd, min(READ_CHUNK, max_size + 1 - total), total)
            if not chunk:
                return total
            total += len(chunk)
            if total > max_size:
                raise Refused("too_big", f"{src} is more than the {max_size} bytes allowed")
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
    except BaseException:
        os.close(out)
        out = -1
        dst.unlink(missing_ok=True)
        raise
    finally:
        if out >= 0:
            os.close(out)


def write_replacing(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``path`` whole, in a directory anyone may write: through a fresh temporary file
    that is never a name someone planted (``O_EXCL | O_NOFOLLOW``), then renamed over it, so a
    reader sees the old file or the new one. Raises OSError (a planted name we may not remove)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
