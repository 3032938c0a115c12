"""Who is at the other end of what a thread waits on: the other holders of a pipe or FIFO, the
socket at the other end of a connection and the processes that hold it, and a process's sockets
at a glance (``io``: what it listens on, what holds bytes nobody has read).

The holders of an object are found by one scan of every process's descriptors on the node
(``/proc/*/fd``: pipes and sockets by inode, anything else by the path the kernel shows), shared
by the questions of one step (a hung process's children all use the scan made after their step
began), cut at the caller's deadline and capped in size;
a cut scan says so (``peers_complete``), since "nobody writes this pipe" is only true of a whole
scan. Every read is of /proc and the kernel's socket tables; no user's file is opened, and a
process or descriptor that vanishes while we look is skipped.

Limits: a FIFO is matched by the path the kernel shows for it, so a holder that sees it under
another name (another mount namespace, another hard link) is not found. The bytes waiting in a
pipe are not measured: ``FIONREAD`` needs a descriptor of the pipe, and taking one of a user's
(``pidfd_getfd``) would make the daemon wait on the pipe's lock, which a user can hold.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import net_tables
from .net_tables import InetSocket, Tables, UnixEntry
from .procfs import PROC, fd_mode, read_capped
from .sock_diag import UnixDiag, UnixSocket

MAX_PEERS = 64  # holders listed for one object
MAX_SCAN_FDS = 1 << 18  # descriptors looked at in one scan of the node (the rest: an incomplete scan)
MAX_IO_SOCKETS = 256  # sockets of one process described for ``io``

_FAMILIES = {"TCP": "tcp", "TCPV6": "tcp6", "UDP": "udp", "UDPV6": "udp6"}


@dataclass
class Snapshot:
    """Every descriptor on the node that can be the other end of a wait, as (pid << 32 | fd)."""

    pipes: dict[int, list[int]] = field(default_factory=dict)
    sockets: dict[int, list[int]] = field(default_factory=dict)
    paths: dict[str, list[int]] = field(default_factory=dict)
    complete: bool = True
    started: float = 0.0  # time.monotonic() when the scan began


def _inode(target: str) -> int | None:
    # "pipe:[1234]", "socket:[1234]"
    try:
        return int(target[target.index("[") + 1: -1])
    except ValueError:
        return None


def scan(end: float) -> Snapshot:
    """Read every process's descriptor table, until ``end`` (time.monotonic()) or ``MAX_SCAN_FDS``."""
    snap = Snapshot(started=time.monotonic())
    me, seen = os.getpid(), 0
    try:
        entries = os.listdir(PROC)
    except OSError:
        snap.complete = False
        return snap
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        if time.monotonic() > end or seen >= MAX_SCAN_FDS:
            snap.complete = False
            break
        pid = int(entry)
        base = f"/proc/{entry}/fd/"
        try:
            fds = os.listdir(base)
        except OSError:
            continue  # gone, or a kernel thread's
        seen += len(fds)
        for fd in fds:
            try:
                target = os.readlink(base + fd)
            except OSError:
                continue  # closed while we looked
            packed = pid << 32 | int(fd)
            if target.startswith("pipe:"):
                ino = _inode(target)
                if ino is not None:
                    snap.pipes.setdefault(ino, []).append(packed)
            elif target.startswith("socket:"):
                ino = _inode(target)
                if ino is not None:
                    snap.sockets.setdefault(ino, []).append(packed)
            elif target.startswith("/"):
                snap.paths.setdefault(target, []).append(packed)
    return snap


_recent: Snapshot | None = None
_lock = threading.Lock()


def snapshot(end: float, not_before: float) -> Snapshot:
    """A whole scan of the node begun at ``not_before`` or later (time.monotonic()): it saw every
    descriptor that was open then and still is. The questions of one step share it; a scan under
    way is waited for no longer than ``end``."""
    global _recent
    if not _lock.acquire(timeout=max(0.0, end - time.monotonic())):
        return Snapshot(complete=False)
    try:
        if _recent is not None and _recent.started >= not_before:
            return _recent
        snap = scan(end)
        _recent = snap if snap.complete else None
        return snap
    finally:
        _lock.release()


def _fdinfo_ino(pid: int, fd: int) -> int | None:
    try:
        text = read_capped(PROC / str(pid) / "fdinfo" / str(fd), 4096)
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(b"ino:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def _status_uid(pid: int) -> int | None:
    try:
        text = read_capped(PROC / str(pid) / "status", 16 << 10)
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(b"Uid:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


class Looker:
    """One capture's look at the other ends: the node's scan, the socket tables and the netlink
    sockets of each network namespace, read at most once and shared by every question."""

    def __init__(self, end: float, not_before: float | None = None) -> None:
        """``end``: the deadline of every read; ``not_before``: the scan of the node may be one
        begun then or later (by default, one begun now)."""
        self.end = end
        self.not_before = time.monotonic() if not_before is None else not_before
        self.tables = Tables(end)
        self._snap: Snapshot | None = None
        self._diag: dict[int, UnixDiag] = {}
        self._procs: dict[int, tuple[str, int | None]] = {}
        self._done: dict[tuple[object, ...], tuple[dict[str, Any] | None, list[dict[str, Any]] | None]] = {}

    def close(self) -> None:
        for d in self._diag.values():
            d.close()
        self._diag.clear()

    def __enter__(self) -> Looker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def snap(self) -> Snapshot:
        if self._snap is None:
            self._snap = snapshot(self.end, self.not_before)
        return self._snap

    def diag(self, pid: int) -> UnixDiag | None:
        ns = net_tables.netns(pid)
        if ns is None:
            return None
        if ns not in self._diag:
            self._diag[ns] = UnixDiag(pid)
        return self._diag[ns]

    def _who(self, pid: int) -> tuple[str, int | None]:
        if pid not in self._procs:
            try:
                comm = read_capped(PROC / str(pid) / "comm", 64).decode("utf-8", "replace").strip()
            except OSError:
                comm = ""
            self._procs[pid] = (comm, _status_uid(pid))
        return self._procs[pid]

    # -- holders -------------------------------------------------------------

    def holders(self, packed: list[int], me: int, exclude: tuple[int, int] | None = None,
                ino: int | None = None) -> list[dict[str, Any]]:
        """The holders in ``packed`` (from the scan) as records: pid, fd, mode, comm, uid,
        same_process; ``exclude`` (pid, fd) left out, and with ``ino`` only descriptors that
        still hold that inode (a number reused since the scan is not the object)."""
        out = []
        for p in packed:
            pid, fd = p >> 32, p & 0xFFFFFFFF
            if (pid, fd) == exclude:
                continue
            if ino is not None and _fdinfo_ino(pid, fd) not in (ino, None):
                continue
            mode = fd_mode(pid, fd)
            if mode is None:
                continue  # closed since the scan
            comm, uid = self._who(pid)
            out.append({"pid": pid, "fd": fd, "mode": mode, "comm": comm, "uid": uid, "same_process": pid == me})
            if len(out) >= MAX_PEERS:
                break
        return out

    # -- sockets ---------------------------------------------------------------

    def socket(self, pid: int, fd: int | None, inode: int) -> tuple[dict[str, Any], list[int]]:
        """What socket ``inode`` (descriptor ``fd`` of ``pid``) is, and the inodes of the sockets
        at its other end: its peer, or a listener's connections not yet accepted."""
        proto = ""
        if fd is not None:
            try:
                proto = os.getxattr(PROC / str(pid) / "fd" / str(fd), "system.sockprotoname").rstrip(b"\0").decode()
            except OSError:
                proto = ""
        if proto.upper().startswith("UNIX"):
            return self._unix(pid, inode) or ({"family": "unix", "error": "not found in the kernel's tables"}, [])
        family = _FAMILIES.get(proto.upper())
        if family:
            entry = self.tables.inet(pid, inode, family)
            return self._inet(pid, entry) if entry else ({"family": family, "error": f"not in /proc/net/{family}"}, [])
        if proto:  # netlink, packet, raw, ...: nothing at the other end to name
            return {"family": proto.lower()}, []
        found = self._unix(pid, inode)  # no protocol name (an old kernel): each table in turn
        if found is not None:
            return found
        for fam in net_tables.INET:
            entry = self.tables.inet(pid, inode, fam)
            if entry is not None:
                return self._inet(pid, entry)
        return {"family": "unknown"}, []

    def _unix(self, pid: int, inode: int) -> tuple[dict[str, Any], list[int]] | None:
        diag = self.diag(pid)
        s = diag.query(inode) if diag else None
        if s is None:
            entry = self.tables.get(pid, "unix").by_inode.get(inode)
            if not isinstance(entry, UnixEntry):
                return None
            info: dict[str, Any] = {"family": "unix", "type": entry.type,
                                    "state": "LISTEN" if entry.listening else "ESTABLISHED" if entry.connected else "UNCONNECTED",
                                    "local": entry.path, "remote": None, "rx_queue": None, "tx_queue": None, "peer_inode": None}
            if diag and diag.error:
                info["error"] = diag.error
            return info, []
        info = _unix_info(s)
        if s.peer and diag:
            other = diag.query(s.peer)
            info["remote"] = other.name if other else None
        return info, ([s.peer] if s.peer else list(s.pending))

    def _inet(self, pid: int, e: InetSocket) -> tuple[dict[str, Any], list[int]]:
        info: dict[str, Any] = {"family": e.family, "state": e.state, "rx_queue": e.rx_queue, "tx_queue": e.tx_queue,
                                "local": net_tables.show(e.local), "remote": net_tables.show(e.remote), "peer_inode": None}
        if e.state == "LISTEN":
            info["rx_queue"] = 0
            info["backlog"] = e.rx_queue  # /proc/net/tcp shows a listener's accept queue there
            clients = [self.tables.other_end(pid, c) for c in self.tables.pending(pid, e)]
            return info, [c.inode for c in clients if c is not None and c.inode]
        other = self.tables.other_end(pid, e)
        if other is not None and other.inode:
            info["peer_inode"] = other.inode
            return info, [other.inode]
        if other is not None:  # in a listener's accept queue: whoever holds the listener is the other end
            info["peer_accepted"] = False
            listening = self.tables.listener(pid, other.local, e.family.rstrip("6"))
            return info, [listening.inode] if listening and listening.inode else []
        return info, []

    def listener(self, pid: int, address: str) -> int | None:
        """The inode of the socket listening at ``address`` (a Unix path or "@name", HOST:PORT)."""
        if address.startswith(("/", "@")):
            entry = self.tables.unix_listener(pid, address)
            return entry.inode if entry else None
        host, _, port = address.rpartition(":")
        try:
            found = self.tables.listener(pid, (host.strip("[]"), int(port)))
        except ValueError:
            return None
        return found.inode if found and found.inode else None

    # -- a wait ------------------------------------------------------------------

    def annotate(self, pid: int, wait: dict[str, Any]) -> None:
        """Add ``socket`` and ``peers`` to a wait from ``blocked_on`` (and to each of its ``fds``)."""
        self._one(pid, wait)
        for d in wait.get("fds") or []:
            if time.monotonic() > self.end:
                break
            self._one(pid, d)

    def _one(self, pid: int, d: dict[str, Any]) -> None:
        # Threads of one process often wait on the same descriptor (a pool in one epoll set): once.
        key = (pid, d.get("kind"), d.get("fd"), d.get("path"), d.get("connect_to"))
        if key not in self._done:
            self._done[key] = self._other_end(pid, d)
        info, peers = self._done[key]
        if info is not None:
            d["socket"] = info
        if peers is not None:
            d["peers"] = peers
            d["peers_complete"] = self.snap.complete

    def _other_end(self, pid: int, d: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
        kind, fd, path = d.get("kind"), d.get("fd"), d.get("path")
        info: dict[str, Any] | None = None
        peers: list[dict[str, Any]] | None = None
        if kind == "pipe" and isinstance(path, str):
            ino = _inode(path)
            if ino is not None:
                peers = self.holders(self.snap.pipes.get(ino, []), pid, (pid, fd) if isinstance(fd, int) else None, ino)
        elif kind == "FIFO" and isinstance(path, str):
            obj = d.get("object")
            ino = obj[1] if isinstance(obj, list) and len(obj) == 2 and isinstance(fd, int) else None
            packed = self.snap.paths.get(path, []) + self.snap.paths.get(path + " (deleted)", [])
            peers = self.holders(packed, pid, (pid, fd) if isinstance(fd, int) else None, ino)
        elif kind == "socket" and isinstance(path, str) and (ino := _inode(path)) is not None:
            info, others = self.socket(pid, fd if isinstance(fd, int) else None, ino)
            to = d.get("connect_to")
            if not others and isinstance(to, str):
                listening = self.listener(pid, to)
                others = [listening] if listening else []
            peers = []
            for other in others:
                peers += self.holders(self.snap.sockets.get(other, []), pid, ino=other)
            peers = peers[:MAX_PEERS]
        return info, peers

    # -- a process's sockets ---------------------------------------------------------

    def io(self, pid: int, targets: dict[int, str]) -> dict[str, Any]:
        """What ``pid``'s sockets hold: ``listening`` (fd, local, backlog: connections waiting to be
        accepted) and ``unread`` (fd, kind, rx_queue: bytes, or for UDP the queue's memory, nobody
        has read). Pipes are not measured (see the module's text)."""
        listening: list[dict[str, Any]] = []
        unread: list[dict[str, Any]] = []
        socks = sorted((fd, t) for fd, t in targets.items() if t.startswith("socket:"))
        complete = len(socks) <= MAX_IO_SOCKETS
        for fd, target in socks[:MAX_IO_SOCKETS]:
            if time.monotonic() > self.end:
                complete = False
                break
            ino = _inode(target)
            if ino is None:
                continue
            info, _ = self.socket(pid, fd, ino)
            if info.get("state") == "LISTEN":
                listening.append({"fd": fd, "local": info.get("local"), "backlog": info.get("backlog")})
            elif (info.get("rx_queue") or 0) > 0:
                unread.append({"fd": fd, "kind": info.get("family"), "rx_queue": info["rx_queue"]})
        return {"listening": listening, "unread": unread, "sockets": len(socks), "complete": complete}


def _unix_info(s: UnixSocket) -> dict[str, Any]:
    info: dict[str, Any] = {"family": "unix", "type": s.type, "state": s.state, "rx_queue": s.rx_queue,
                            "tx_queue": s.tx_queue, "local": s.name, "remote": None, "peer_inode": s.peer}
    if s.backlog is not None:
        info["backlog"] = s.backlog
    return info
