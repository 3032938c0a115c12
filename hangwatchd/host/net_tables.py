"""The kernel's socket tables as a process sees them: ``/proc/PID/net/{tcp,tcp6,udp,udp6,unix}``.

Each is the table of the process's own network namespace, so a container's sockets are found
too. A table is read once per namespace and capture (``Tables``), capped in bytes and cut at a
deadline; a cut table says so (``complete``), and what it lacks is simply not found.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass, field

from .procfs import PROC

MAX_TABLE = 16 << 20  # bytes of one table read (a server with 100,000 connections: about 15 MB)

# include/net/tcp_states.h
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
              7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING", 12: "NEW_SYN_RECV"}
INET = ("tcp", "tcp6", "udp", "udp6")


@dataclass(frozen=True)
class InetSocket:
    family: str  # "tcp", "tcp6", "udp", "udp6"
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str
    tx_queue: int
    rx_queue: int  # for a listener: connections waiting to be accepted
    inode: int  # 0 for a connection no process holds yet (not accepted)


@dataclass(frozen=True)
class UnixEntry:
    inode: int
    type: str  # "stream", "dgram", "seqpacket"
    listening: bool
    connected: bool
    path: str  # "" unbound, "@name" abstract


@dataclass
class Table:
    complete: bool = True
    by_inode: dict[int, object] = field(default_factory=dict)
    entries: list[object] = field(default_factory=list)


def netns(pid: int) -> int | None:
    """The network namespace ``pid`` lives in (its inode), None when it is gone."""
    try:
        return os.stat(PROC / str(pid) / "ns" / "net").st_ino
    except OSError:
        return None


def _addr(text: str) -> tuple[str, int]:
    """('127.0.0.1', 8080) from '0100007F:1F90' (each 32-bit word printed in host order); an
    IPv4 address mapped into IPv6 (::ffff:a.b.c.d) as plain IPv4, so both sides of one
    connection compare equal whatever table each is in."""
    hexaddr, _, hexport = text.partition(":")
    words = [int(hexaddr[i:i + 8], 16) for i in range(0, len(hexaddr), 8)]
    raw = b"".join(struct.pack("=I", w) for w in words)
    port = int(hexport, 16)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw), port
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, raw[12:]), port
    return socket.inet_ntop(socket.AF_INET6, raw), port


def show(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _lines(pid: int, name: str, end: float) -> tuple[list[bytes], bool]:
    """The table's rows (header dropped) and whether all of it was read."""
    try:
        fd = os.open(PROC / str(pid) / "net" / name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return [], False
    parts: list[bytes] = []
    total, complete = 0, True
    try:
        while True:
            if time.monotonic() > end or total >= MAX_TABLE:
                complete = False
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
    except OSError:
        complete = False
    finally:
        os.close(fd)
    rows = b"".join(parts).split(b"\n")[1:]
    if not complete and rows:
        rows = rows[:-1]  # the last row may be cut
    return [r for r in rows if r.strip()], complete


def read_inet(pid: int, family: str, end: float) -> Table:
    rows, complete = _lines(pid, family, end)
    table = Table(complete)
    udp = family.startswith("udp")
    for row in rows:
        cols = row.split()
        try:
            st = int(cols[3], 16)
            tx, _, rx = cols[4].partition(b":")
            entry = InetSocket(family, _addr(cols[1].decode()), _addr(cols[2].decode()),
                               ("UNCONN" if udp and st == 7 else TCP_STATES.get(st, str(st))),
                               int(tx, 16), int(rx, 16), int(cols[9]))
        except (IndexError, ValueError, OSError):
            continue
        table.entries.append(entry)
        if entry.inode:
            table.by_inode[entry.inode] = entry
    return table


def read_unix(pid: int, end: float) -> Table:
    rows, complete = _lines(pid, "unix", end)
    table = Table(complete)
    for row in rows:
        cols = row.split(None, 7)
        try:
            flags, typ, st, ino = int(cols[3], 16), int(cols[4], 16), int(cols[5], 16), int(cols[6])
        except (IndexError, ValueError):
            continue
        path = cols[7].decode("utf-8", "surrogateescape") if len(cols) > 7 else ""
        entry = UnixEntry(ino, {1: "stream", 2: "dgram", 5: "seqpacket"}.get(typ, str(typ)),
                          bool(flags & 0x10000), st == 3, path)
        table.entries.append(entry)
        table.by_inode[ino] = entry
    return table


class Tables:
    """Each network namespace's tables, read at most once (per capture: make a new one each time)."""

    def __init__(self, end: float) -> None:
        self.end = end
        self._cache: dict[tuple[int, str], Table] = {}

    def get(self, pid: int, name: str) -> Table:
        ns = netns(pid)
        if ns is None:
            return Table(False)
        key = (ns, name)
        if key not in self._cache:
            self._cache[key] = read_unix(pid, self.end) if name == "unix" else read_inet(pid, name, self.end)
        return self._cache[key]

    def inet(self, pid: int, inode: int, family: str) -> InetSocket | None:
        entry = self.get(pid, family).by_inode.get(inode)
        return entry if isinstance(entry, InetSocket) else None

    def other_end(self, pid: int, me: InetSocket) -> InetSocket | None:
        """The socket at the other end of ``me``'s connection, where it is in the same namespace
        (a connection on loopback, or to one of the node's own addresses)."""
        if me.state == "LISTEN" or me.remote[1] == 0:
            return None
        proto = me.family.rstrip("6")
        for fam in (proto, proto + "6"):
            for e in self.get(pid, fam).entries:
                if isinstance(e, InetSocket) and e.local == me.remote and e.remote == me.local:
                    return e
        return None

    def pending(self, pid: int, listener: InetSocket) -> list[InetSocket]:
        """Connections a TCP listener has not accepted yet: established, on its port, held by no process."""
        if listener.state != "LISTEN":
            return []
        out = []
        for fam in ("tcp", "tcp6"):
            for e in self.get(pid, fam).entries:
                if (isinstance(e, InetSocket) and e.inode == 0 and e.local[1] == listener.local[1]
                        and e.state in ("ESTABLISHED", "SYN_RECV", "CLOSE_WAIT")
                        and listener.local[0] in (e.local[0], "0.0.0.0", "::")):
                    out.append(e)
        return out

    def listener(self, pid: int, addr: tuple[str, int], proto: str = "tcp") -> InetSocket | None:
        """The socket listening for connections to ``addr`` (its own address, or any)."""
        best = None
        for fam in (proto, proto + "6"):
            for e in self.get(pid, fam).entries:
                if isinstance(e, InetSocket) and e.state == "LISTEN" and e.local[1] == addr[1]:
                    if e.local[0] == addr[0]:
                        return e
                    if e.local[0] in ("0.0.0.0", "::"):
                        best = e
        return best

    def unix_listener(self, pid: int, path: str) -> UnixEntry | None:
        for e in self.get(pid, "unix").entries:
            if isinstance(e, UnixEntry) and e.listening and e.path == path:
                return e
        return None
