"""What a process (or one of its threads) waits for, from /proc: its wait channel, the system call
it sleeps in, and the file, FIFO, socket or pipe behind the descriptor that call blocks on.

``/proc/PID/syscall`` names the call and its arguments (root, or ptrace rights over the process);
a call on one descriptor (read, recv, accept, ...) names it in its first argument. A call that
waits on many keeps them elsewhere: an epoll set is listed in ``/proc/PID/fdinfo/EPFD``; the
arrays given to poll and select, the path given to open and the address given to connect are in
the process's memory, read only where that is safe (``process_memory``). Where the set cannot be
read, the descriptors the process holds that can block (pipes, FIFOs, sockets) are listed
instead, and ``fds_from`` says which it is.

Who holds the other end of what it waits on is ``peers``' work, not this module's.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import stat
import struct
from pathlib import Path
from typing import Any

from . import process_memory
from .procfs import PROC, fd_targets, read_capped

# System call numbers by architecture, for the calls a hung process sleeps in.
_CALLS = {
    "x86_64": {0: "read", 1: "write", 2: "open", 7: "poll", 17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev",
               23: "select", 35: "nanosleep", 42: "connect", 43: "accept", 44: "sendto", 45: "recvfrom",
               46: "sendmsg", 47: "recvmsg", 61: "wait4", 73: "flock", 202: "futex", 230: "clock_nanosleep",
               232: "epoll_wait", 247: "waitid", 257: "openat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait",
               288: "accept4", 16: "ioctl", 74: "fsync", 34: "pause", 130: "rt_sigsuspend", 128: "rt_sigtimedwait",
               299: "recvmmsg", 307: "sendmmsg", 437: "openat2", 441: "epoll_pwait2"},
    "aarch64": {63: "read", 64: "write", 67: "pread64", 68: "pwrite64", 65: "readv", 66: "writev", 72: "pselect6",
                73: "ppoll", 101: "nanosleep", 203: "connect", 202: "accept", 206: "sendto", 207: "recvfrom",
                211: "sendmsg", 212: "recvmsg", 260: "wait4", 32: "flock", 98: "futex", 115: "clock_nanosleep",
                22: "epoll_pwait", 95: "waitid", 56: "openat", 242: "accept4", 29: "ioctl", 82: "fsync",
                133: "rt_sigsuspend", 137: "rt_sigtimedwait", 243: "recvmmsg", 269: "sendmmsg", 437: "openat2",
                441: "epoll_pwait2"},
}
_VERB = {"read": "reading", "pread64": "reading", "readv": "reading", "recvfrom": "receiving on", "recvmsg": "receiving on",
         "recvmmsg": "receiving on", "write": "writing", "pwrite64": "writing", "writev": "writing",
         "sendto": "sending on", "sendmsg": "sending on", "sendmmsg": "sending on",
         "accept": "accepting on", "accept4": "accepting on", "connect": "connecting", "flock": "locking",
         "ioctl": "in ioctl on", "fsync": "syncing"}
_EPOLL = frozenset({"epoll_wait", "epoll_pwait", "epoll_pwait2"})
_POLL = frozenset({"poll", "ppoll"})
_SELECT = frozenset({"select", "pselect6"})
_MANY = _EPOLL | _POLL | _SELECT
_OPEN = frozenset({"open", "openat", "openat2"})
# Wait channels of an open of a FIFO that waits for the other end (fs/pipe.c).
_FIFO_WCHANS = frozenset({"wait_for_partner", "fifo_open", "pipe_wait"})
MAX_FDS = 32  # descriptors listed for a wait on many
MAX_POLLFDS = 512  # entries of a poll array read (4 KiB)
MAX_SELECT_FDS = 1024  # FD_SETSIZE
MAX_EPOLL_INFO = 256 << 10  # bytes of an epoll descriptor's fdinfo read
AT_FDCWD = -100


def syscall_names() -> dict[int, str]:
    return _CALLS.get(platform.machine(), {})


def describe_fd(pid: int, fd: int, target: str | None = None) -> dict[str, Any]:
    """What descriptor ``fd`` of ``pid`` is: kind (FIFO, pipe, socket, file, device), path, and the
    (device, inode) pair that tells whether two processes hold the same one."""
    link = PROC / str(pid) / "fd" / str(fd)
    if target is None:
        try:
            target = os.readlink(link)
        except OSError:
            return {"fd": fd, "kind": "unknown"}
    out: dict[str, Any] = {"fd": fd, "path": target}
    if target.startswith("pipe:"):
        out["kind"] = "pipe"
    elif target.startswith("socket:"):
        out["kind"] = "socket"
        peer = _unix_socket_path(pid, target)
        if peer:
            out["socket_path"] = peer
    elif target.startswith("anon_inode:"):
        out["kind"] = target.split(":", 1)[1].strip("[]")
    else:
        try:
            # stat of the very object the process holds (the magic link), never a path re-resolved.
            st = os.stat(link)
        except OSError:
            out["kind"] = "file"
            return out
        out["kind"] = ("FIFO" if stat.S_ISFIFO(st.st_mode) else "device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                       else "file")
        out["object"] = [st.st_dev, st.st_ino]
        return out
    out["object"] = [0, _inode(target)]
    return out


def _inode(target: str) -> int:
    digits = "".join(c for c in target if c.isdigit())
    return int(digits) if digits else 0


def _unix_socket_path(pid: int, target: str) -> str | None:
    """The path a Unix socket is bound to, from /proc/PID/net/unix, where it has one."""
    ino = str(_inode(target))
    try:
        with open(PROC / str(pid) / "net" / "unix", "rb") as f:
            for raw in f.read(1 << 20).splitlines()[1:]:
                cols = raw.decode("utf-8", "replace").split()
                if len(cols) >= 8 and cols[6] == ino:
                    return cols[7]
    except OSError:
        return None
    return None


def _text(d: dict[str, Any]) -> str:
    kind, path = d.get("kind"), d.get("path")
    if kind in ("FIFO", "file", "device"):
        return f"{kind} {path}"
    if kind == "socket" and d.get("socket_path"):
        return f"socket {d['socket_path']}"
    return f"{kind} {path}" if kind not in ("pipe", "socket") else f"a {kind} ({path})"


def blocked_on(pid: int, tid: int | None = None, owner_uid: int | None = None) -> dict[str, Any]:
    """What ``pid`` (or its thread ``tid``) waits for: ``wchan``, ``syscall``, the ``fd`` with its
    ``kind``, ``path`` and ``object``, or ``fds`` for a wait on many, and ``text``: one phrase.
    ``owner_uid``: the uid the process runs as, where known (see ``process_memory``)."""
    return Waits(pid, owner_uid).of(tid)


class Waits:
    """The waits of one process's threads, reading its descriptor table at most once."""

    def __init__(self, pid: int, owner_uid: int | None = None) -> None:
        self.pid = pid
        self.owner_uid = owner_uid
        self._targets: dict[int, str] | None = None
        self._epoll: dict[int, list[tuple[int, str | None]] | None] = {}  # a pool's threads share one set

    def targets(self) -> dict[int, str]:
        if self._targets is None:
            self._targets = fd_targets(self.pid)
        return self._targets

    def target(self, fd: int) -> str | None:
        """What ``fd`` points at, from the table where it was read already (else describe_fd reads it)."""
        return self._targets.get(fd) if self._targets is not None else None

    def of(self, tid: int | None = None) -> dict[str, Any]:
        pid = self.pid
        base = PROC / str(pid) / ("task/" + str(tid) if tid is not None else "")
        out: dict[str, Any] = {}
        wchan = _read(base / "wchan")
        if wchan and wchan != "0":
            out["wchan"] = wchan
        raw = _read(base / "syscall")
        if raw is None:
            out["text"] = f"asleep in {wchan}" if wchan and wchan != "0" else "unknown (no access to /proc/PID/syscall)"
            return out
        if raw == "running":
            out["syscall"] = None
            out["text"] = "running"
            return out
        fields = raw.split()
        try:
            nr = int(fields[0])
            args = [int(a, 16) for a in fields[1:7]]
        except (ValueError, IndexError):
            out["text"] = f"asleep in {wchan}" if wchan else "unknown"
            return out
        if nr < 0:  # blocked, but not in a system call (a page fault, a stop)
            out["syscall"] = None
            out["text"] = f"blocked outside a system call ({wchan or 'no wait channel'})"
            return out
        name = syscall_names().get(nr, f"system call {nr}")
        out["syscall"] = name
        if name in _VERB and args:
            fd = _int32(args[0])
            d = describe_fd(pid, fd, self.target(fd))
            out.update(d)
            out["text"] = f"{_VERB[name]} {_text(d)}"
            if name == "connect" and len(args) > 2:
                to = self._sockaddr(args[1], args[2])
                if to:
                    out["connect_to"] = to
                    out["text"] += f" to {to}"
        elif name in _MANY:
            fds, source, total = self._many(name, args)
            out["fds"] = fds
            out["fds_from"] = source
            if total is not None:
                out["fds_total"] = total
            what = ", ".join(_text(d) for d in fds[:4]) or ("no pipe, FIFO or socket" if source == "held" else "no descriptor")
            out["text"] = f"waiting in {name} on {what}"
        elif name in ("wait4", "waitid"):
            child = args[1] if name == "waitid" else args[0]
            if name == "wait4" and child >= 1 << 63:
                child -= 1 << 64
            out["text"] = "waiting for a child process to exit" + (f" (pid {child})" if 0 < child < 1 << 31 else "")
        elif name == "futex":
            out["text"] = "waiting on a futex (a lock, a condition or a join)"
        elif name in ("nanosleep", "clock_nanosleep"):
            out["text"] = "sleeping"
        elif name in _OPEN:
            out.update(self._opening(name, args, wchan or ""))
        else:
            out["text"] = f"in {name}"
        return out

    # -- a wait on many ----------------------------------------------------

    def _many(self, name: str, args: list[int]) -> tuple[list[dict[str, Any]], str, int | None]:
        """(the descriptors waited on, where that list comes from, how many there are in all)."""
        found: list[tuple[int, str | None]] | None = None
        source = name.split("_")[0] if name in _EPOLL else "poll" if name in _POLL else "select"
        if name in _EPOLL:
            epfd = _int32(args[0])
            if epfd not in self._epoll:
                self._epoll[epfd] = epoll_set(self.pid, epfd)
            found = self._epoll[epfd]
        elif name in _POLL and len(args) > 1:
            found = self._poll_set(args[0], args[1])
        elif name in _SELECT and len(args) > 2:
            found = self._select_set(args[0], args[1], args[2])
        if found is None:
            return waitable_fds(self.pid, self.targets()), "held", None
        out = []
        for fd, wants in found[:MAX_FDS]:
            d = describe_fd(self.pid, fd, self.target(fd))
            if wants:
                d["wants"] = wants
            out.append(d)
        return out, source, len(found)

    def _poll_set(self, addr: int, nfds: int) -> list[tuple[int, str | None]] | None:
        if nfds > MAX_POLLFDS:
            return None
        if nfds == 0:
            return []
        raw = process_memory.read(self.pid, addr, nfds * 8, self.owner_uid)
        if raw is None or len(raw) < nfds * 8:
            return None
        out = []
        for i in range(nfds):
            fd, events, _ = struct.unpack_from("=ihh", raw, i * 8)
            if fd >= 0:
                out.append((fd, _wants(bool(events & 0x1 or events & 0x40), bool(events & 0x4 or events & 0x100))))
        return out

    def _select_set(self, nfds: int, readfds: int, writefds: int) -> list[tuple[int, str | None]] | None:
        if nfds > MAX_SELECT_FDS:
            return None
        size = (nfds + 63) // 64 * 8
        sets = []
        for addr in (readfds, writefds):
            if addr == 0:
                sets.append(0)
                continue
            raw = process_memory.read(self.pid, addr, size, self.owner_uid) if size else b""
            if raw is None or len(raw) < size:
                return None
            sets.append(int.from_bytes(raw, "little"))
        r, w = sets
        return [(fd, _wants(bool(r >> fd & 1), bool(w >> fd & 1))) for fd in range(nfds) if (r | w) >> fd & 1]

    # -- an open, a connect ---------------------------------------------------

    def _opening(self, name: str, args: list[int], wchan: str) -> dict[str, Any]:
        """What an open that blocks is opening: a FIFO with no other end, most often."""
        out: dict[str, Any] = {}
        if name == "open":
            dirfd, ptr, flags = AT_FDCWD, args[0], args[1] if len(args) > 1 else 0
        else:
            dirfd, ptr = _int32(args[0]), args[1] if len(args) > 1 else 0
            flags = args[2] if name == "openat" and len(args) > 2 else 0
            if name == "openat2" and len(args) > 2:
                how = process_memory.read(self.pid, args[2], 8, self.owner_uid)
                flags = struct.unpack("=Q", how)[0] if how and len(how) == 8 else 0
        fifo = wchan in _FIFO_WCHANS
        mode = {os.O_RDONLY: "r", os.O_WRONLY: "w"}.get(flags & 3, "rw")
        path = process_memory.read_string(self.pid, ptr, self.owner_uid)
        if path is None:
            out["path_error"] = ("the path is not in the process's own anonymous memory (a string in a "
                                 "program's file, or shared memory): not read")
        else:
            path = self._resolve(dirfd, path)
            out["path"] = path
        out["kind"] = "FIFO" if fifo else "file"
        out["mode"] = mode
        where = f" {path}" if path else ""
        if fifo:
            other = "writing" if mode == "r" else "reading"
            out["text"] = (f"opening FIFO{where} for {'reading' if mode == 'r' else 'writing'}: "
                           f"no process has it open for {other}")
        else:
            out["text"] = f"opening{where or ' a file'}"
        return out

    def _resolve(self, dirfd: int, path: str) -> str:
        """The path as the process means it: relative ones joined to its directory or ``dirfd``'s."""
        if path.startswith("/"):
            return path
        try:
            base = os.readlink(PROC / str(self.pid) / ("cwd" if dirfd == AT_FDCWD else f"fd/{dirfd}"))
        except OSError:
            return path
        return os.path.join(base, path)

    def _sockaddr(self, addr: int, length: int) -> str | None:
        """The address a connect names: a Unix path ("@name" abstract), or HOST:PORT."""
        if not 2 <= length <= 128:
            return None
        raw = process_memory.read(self.pid, addr, length, self.owner_uid)
        if raw is None or len(raw) < 2:
            return None
        family = struct.unpack_from("=H", raw)[0]
        if family == socket.AF_UNIX:
            body = raw[2:]
            if body[:1] == b"\0":
                return "@" + body[1:].decode("utf-8", "surrogateescape")
            return body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape") or None
        if family == socket.AF_INET and len(raw) >= 8:
            return f"{socket.inet_ntop(socket.AF_INET, raw[4:8])}:{struct.unpack_from('>H', raw, 2)[0]}"
        if family == socket.AF_INET6 and len(raw) >= 24:
            return f"[{socket.inet_ntop(socket.AF_INET6, raw[8:24])}]:{struct.unpack_from('>H', raw, 2)[0]}"
        return None


def _int32(v: int) -> int:
    """A descriptor argument as the int it was (AT_FDCWD is -100, printed as 0xffffff9c or wider)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _wants(r: bool, w: bool) -> str | None:
    return "rw" if r and w else "r" if r else "w" if w else None


def epoll_set(pid: int, epfd: int) -> list[tuple[int, str | None]] | None:
    """The descriptors in an epoll set, with what is waited for on each, from its fdinfo ("tfd:"
    lines); None where it cannot be read."""
    if epfd < 0:
        return None
    try:
        raw = read_capped(PROC / str(pid) / "fdinfo" / str(epfd), MAX_EPOLL_INFO)
    except OSError:
        return None
    out = []
    for line in raw.splitlines():
        if not line.startswith(b"tfd:"):
            continue
        cols = line.split()
        try:
            fd = int(cols[1])
            events = int(cols[cols.index(b"events:") + 1], 16)
        except (IndexError, ValueError):
            continue
        out.append((fd, _wants(bool(events & 0x1), bool(events & 0x4))))
    return out


# The in-process reporter's FIFO (workload/introspect), held for the daemon to ask: never what the
# program itself waits on.
_REPORTER_FIFO = re.compile(r"/introspect-[0-9]+\.pipe(?: \(deleted\))?$")


def waitable_fds(pid: int, targets: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """The descriptors ``pid`` holds that a wait can block on: pipes, FIFOs and sockets (not files)."""
    out = []
    for fd, target in sorted((fd_targets(pid) if targets is None else targets).items()):
        if _REPORTER_FIFO.search(target):
            continue
        if target.startswith(("pipe:", "socket:")):
            out.append(describe_fd(pid, fd, target))
        elif target.startswith("/") and not target.startswith("/dev/"):
            d = describe_fd(pid, fd, target)
            if d.get("kind") == "FIFO":
                out.append(d)
        if len(out) >= MAX_FDS:
            break
    return out


def holders(obj: list[int], pids: list[int]) -> list[int]:
    """Which of ``pids`` hold an open descriptor to ``obj`` (a ``describe_fd`` ``object``)."""
    out = []
    for pid in pids:
        for fd, target in fd_targets(pid).items():
            same = (target.startswith(("pipe:", "socket:")) and obj[0] == 0 and _inode(target) == obj[1])
            if not same and obj[0] != 0 and target.startswith("/"):
                try:
                    st = os.stat(PROC / str(pid) / "fd" / str(fd))
                except OSError:
                    continue
                same = [st.st_dev, st.st_ino] == obj
            if same:
                out.append(pid)
                break
    return out


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii", "replace").strip()
    except OSError:
        return None
