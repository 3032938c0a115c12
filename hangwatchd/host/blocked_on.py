"""What a process (or one of its threads) waits for, from /proc: its wait channel, the system call
it sleeps in, and the file, FIFO, socket or pipe behind the descriptor that call blocks on.

``/proc/PID/syscall`` names the call and its arguments (root, or ptrace rights over the process);
a call on one descriptor (read, recv, accept, ...) names it in its first argument. A call that
waits on many (poll, select, epoll) keeps them in the process's memory: then the descriptors the
process holds that can block (pipes, FIFOs, sockets) are listed instead.
"""

from __future__ import annotations

import os
import platform
import re
import stat
from pathlib import Path
from typing import Any

from .procfs import PROC, fd_targets

# System call numbers by architecture, for the calls a hung process sleeps in.
_CALLS = {
    "x86_64": {0: "read", 1: "write", 7: "poll", 17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev",
               23: "select", 35: "nanosleep", 42: "connect", 43: "accept", 44: "sendto", 45: "recvfrom",
               46: "sendmsg", 47: "recvmsg", 61: "wait4", 73: "flock", 202: "futex", 230: "clock_nanosleep",
               232: "epoll_wait", 247: "waitid", 257: "openat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait",
               288: "accept4", 16: "ioctl", 74: "fsync", 34: "pause", 130: "rt_sigsuspend", 128: "rt_sigtimedwait"},
    "aarch64": {63: "read", 64: "write", 67: "pread64", 68: "pwrite64", 65: "readv", 66: "writev", 72: "pselect6",
                73: "ppoll", 101: "nanosleep", 203: "connect", 202: "accept", 206: "sendto", 207: "recvfrom",
                211: "sendmsg", 212: "recvmsg", 260: "wait4", 32: "flock", 98: "futex", 115: "clock_nanosleep",
                22: "epoll_pwait", 95: "waitid", 56: "openat", 242: "accept4", 29: "ioctl", 82: "fsync",
                133: "rt_sigsuspend", 137: "rt_sigtimedwait"},
}
_VERB = {"read": "reading", "pread64": "reading", "readv": "reading", "recvfrom": "receiving on", "recvmsg": "receiving on",
         "write": "writing", "pwrite64": "writing", "writev": "writing", "sendto": "sending on", "sendmsg": "sending on",
         "accept": "accepting on", "accept4": "accepting on", "connect": "connecting", "flock": "locking",
         "ioctl": "in ioctl on", "fsync": "syncing"}
_MANY = frozenset({"poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait"})
MAX_FDS = 8  # descriptors listed for a wait on many


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


def blocked_on(pid: int, tid: int | None = None) -> dict[str, Any]:
    """What ``pid`` (or its thread ``tid``) waits for: ``wchan``, ``syscall``, the ``fd`` with its
    ``kind``, ``path`` and ``object``, or ``fds`` for a wait on many, and ``text``: one phrase."""
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
        d = describe_fd(pid, args[0])
        out.update(d)
        out["text"] = f"{_VERB[name]} {_text(d)}"
    elif name in _MANY:
        fds = waitable_fds(pid)
        out["fds"] = fds
        what = ", ".join(_text(d) for d in fds[:4]) or "no pipe, FIFO or socket"
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
    elif name == "openat":
        out["text"] = "opening a file (a FIFO with no other end blocks here)"
    else:
        out["text"] = f"in {name}"
    return out


# The in-process reporter's FIFO (workload/introspect), held for the daemon to ask: never what the
# program itself waits on.
_REPORTER_FIFO = re.compile(r"/introspect-[0-9]+\.pipe(?: \(deleted\))?$")


def waitable_fds(pid: int) -> list[dict[str, Any]]:
    """The descriptors ``pid`` holds that a wait can block on: pipes, FIFOs and sockets (not files)."""
    out = []
    for fd, target in sorted(fd_targets(pid).items()):
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
