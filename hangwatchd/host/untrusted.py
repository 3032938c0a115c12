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
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def open_dir(path: str | os.PathLike[str]) -> int:
    """A descriptor of a directory the daemon made (owned by root or by us, never a link): the
    trusted half of every ``UserFile`` in it. Raises OSError when it is not that."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()):
        os.close(fd)
        raise PermissionError(errno.EPERM, f"belongs to uid {st.st_uid}, not to the daemon", str(path))
    return fd


@dataclass(frozen=True)
class UserFile:
    """A file a user named, resolved once (at registration) to a trusted directory's descriptor
    and a plain base name. Every later look is ``openat(dir_fd, name, O_NOFOLLOW)``: whatever the
    user does to any path afterwards (a directory on the way swapped for a link), nothing
    outside that directory is ever reached, and the name is never looked up again from ``/``."""

    dir_fd: int
    name: str  # no '/', not '.' or '..'
    uid: int  # the owner it must have: the user whose process named it
    allow_root: bool = False  # root's own files only where root named the file
    inode: tuple[int, int] | None = None  # (st_dev, st_ino) when it was accepted; None: not made yet
    shown: str = ""  # the path as it was named, for messages and the status

    def __str__(self) -> str:
        return self.shown or self.name

    def open_fd(self, max_size: int | None = None) -> int:
        """A checked fd of the file now (Refused as ``open_fd`` refuses)."""
        return open_fd(self.name, self.uid, allow_root=self.allow_root, max_size=max_size, dir_fd=self.dir_fd)

    def read_bytes(self, max_size: int, deadline: float = 5.0) -> bytes:
        fd = self.open_fd(max_size)
        try:
            return read_fd(fd, str(self), max_size, deadline)
        finally:
            os.close(fd)

    def unlink(self) -> bool:
        """Remove the file, only if it is still the very file accepted (same inode, same owner):
        never another file put under its name since. True when removed."""
        if self.inode is None:
            return False
        try:
            st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
            owner_ok = st.st_uid == self.uid or (self.allow_root and st.st_uid == 0)
            if (st.st_dev, st.st_ino) != self.inode or not owner_ok or not stat.S_ISREG(st.st_mode):
                return False
            # The directory is sticky: between this look and the unlink only the file's owner
            # could put another file of theirs under the name; never someone else's file.
            os.unlink(self.name, dir_fd=self.dir_fd)
            return True
        except OSError:
            return False


def resolve_in(dir_fd: int, dir_path: str | os.PathLike[str], named: str, uid: int, *, allow_root: bool = False,
               must_exist: bool = True, max_size: int | None = None) -> UserFile:
    """Resolve a path a user named to a ``UserFile`` in the trusted directory ``dir_fd``
    (whose path is ``dir_path``), once; Refused unless the path is that directory's own path
    followed by one plain base name, and the file (where it exists) passes ``check``.

    The path is taken only as written: no link, no '..', no directory in between, no other
    spelling of the directory. What the file is checked against is the object found
    through ``dir_fd``, not anything the path leads to.
    """
    base = os.path.basename(named)
    parent = os.path.dirname(named)
    spellings = {os.fspath(dir_path), os.path.realpath(dir_path)}
    if parent not in spellings or base in ("", ".", "..") or "\0" in base:
        raise Refused("outside_dir", f"{named[:300]} is not a file directly in {os.fspath(dir_path)} "
                                     "(named as that directory's path and one plain file name)")
    f = UserFile(dir_fd, base, uid, allow_root, None, named)
    try:
        fd = f.open_fd(max_size)
    except Refused as exc:
        if exc.reason == "missing" and not must_exist:
            return f
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return UserFile(dir_fd, base, uid, allow_root, (st.st_dev, st.st_ino), named)


def write_held_fifo(pid: int, fd: int, uid: int, expect: tuple[int, int], data: bytes) -> None:
    """Write ``data`` into the FIFO that process ``pid`` holds as descriptor ``fd``: only while
    that descriptor is still the FIFO found before (``expect``: its device and inode), owned by
    ``uid`` (root's own FIFO only for a root process). Never blocks.

    The process can put anything under its ``fd`` at any moment (``dup2`` of a read-only fd of
    /etc/passwd). So ``/proc/PID/fd/N`` is resolved once, with ``O_PATH``: a reference to the
    object that opens nothing (no device is opened, no FIFO end taken), and that object is
    checked; the write end is then opened from the daemon's own descriptor of it
    (/proc/self/fd/M, which nobody else can change), checked again, written and closed.
    Refused for anything else; OSError from the write itself (ENXIO: nobody reads it; EAGAIN:
    it is full)."""
    shown = f"/proc/{pid}/fd/{fd}"
    try:
        pin = os.open(shown, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused("missing", f"{shown}: {exc.strerror}") from None
    try:
        st = os.fstat(pin)
        check(st, shown, uid, fifo=True, allow_root=uid == 0)
        if (st.st_dev, st.st_ino) != expect:
            raise Refused("swapped", f"{shown} is no longer the FIFO found before: not written")
        w = os.open(f"/proc/self/fd/{pin}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            now = os.fstat(w)
            if (now.st_dev, now.st_ino) != expect or not stat.S_ISFIFO(now.st_mode):
                raise Refused("swapped", f"{shown} changed while it was opened: not written")
            os.write(w, data)
        finally:
            os.close(w)
    finally:
        os.close(pin)


def check_owner(pid: int, uid: int) -> None:
    """Refused unless ``pid`` runs now as ``uid`` alone (all four uids): a process registered
    as a user's that later exec'd a setuid program is not that user's to have ptraced by root.
    A root registration is root's to act on whatever the process became."""
    if uid == 0:
        return
    now = process_uid(pid)
    if now != uid:
        raise Refused("wrong_owner", f"pid {pid} runs as uid {now} now, not uid {uid} it was registered as")


def json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """A small untrusted JSON object, nested at most ``max_depth`` deep; Refused otherwise.

    The depth is counted before parsing, in one pass that cannot recurse, so ``[[[[...``
    is a refusal, never a RecursionError in whoever reads it.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused("bad_json", f"not UTF-8 ({exc})") from None
    depth = 0
    for m in _JSON_NESTING.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > max_depth:
                raise Refused("bad_json", f"JSON nested more than {max_depth} deep")
        elif c in "]}":
            depth -= 1
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Refused("bad_json", f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise Refused("bad_json", "not a JSON object")
    return data


# A string (with its escapes) is skipped whole; what is left of interest are the brackets.
_JSON_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)
