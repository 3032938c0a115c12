"""What the kernel knows of a Unix socket that ``/proc/net/unix`` does not say: the socket at the
other end (its inode), the bytes waiting in its queues, a listener's pending connections and
who is connecting. Asked through ``NETLINK_SOCK_DIAG`` (``unix_diag``), one socket by inode.

A netlink socket answers for its own network namespace, so a process in a container is asked
about through a netlink socket made inside its namespace (a short-lived thread enters it with
``setns``, makes the socket and ends; the daemon's other threads never change namespace). That
needs root; elsewhere, or where the kernel has no ``unix_diag``, ``UnixDiag.error`` says why and
every answer is None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
import threading
from dataclasses import dataclass

from .procfs import PROC

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
NOCOOKIE = 0xFFFFFFFF
# include/uapi/linux/unix_diag.h
UDIAG_SHOW_NAME, UDIAG_SHOW_PEER, UDIAG_SHOW_ICONS, UDIAG_SHOW_RQLEN = 0x01, 0x04, 0x08, 0x10
UNIX_DIAG_NAME, UNIX_DIAG_PEER, UNIX_DIAG_ICONS, UNIX_DIAG_RQLEN = 0, 2, 3, 4
MAX_ICONS = 64  # pending connections named for one listener
TIMEOUT = 1.0
CLONE_NEWNET = 0x40000000

_REQ = struct.Struct("<BBHIIIII")
_HDR = struct.Struct("<IHHII")
_MSG = struct.Struct("<BBBBIII")
_TYPES = {1: "stream", 2: "dgram", 5: "seqpacket"}
_STATES = {1: "ESTABLISHED", 7: "UNCONNECTED", 10: "LISTEN", 2: "CONNECTING"}


@dataclass(frozen=True)
class UnixSocket:
    inode: int
    type: str  # "stream", "dgram", "seqpacket"
    state: str  # "LISTEN", "ESTABLISHED", "UNCONNECTED"
    name: str  # the address it is bound to ("" none, "@name" abstract)
    peer: int | None  # the inode of the socket at the other end (None: none, or not yet accepted)
    rx_queue: int  # bytes waiting to be read (a listener: 0)
    tx_queue: int
    backlog: int | None  # a listener's connections not yet accepted
    pending: tuple[int, ...]  # a listener's connecting sockets (their inodes), at most MAX_ICONS


def _name(raw: bytes) -> str:
    if raw[:1] == b"\0":
        return "@" + raw[1:].decode("utf-8", "surrogateescape")
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _parse(data: bytes, inode: int) -> UnixSocket | None:
    if len(data) < _HDR.size + _MSG.size:
        return None
    length, mtype = _HDR.unpack_from(data)[:2]
    if mtype != SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: gone, or not a Unix socket
    _fam, typ, state, _pad, ino, _c1, _c2 = _MSG.unpack_from(data, _HDR.size)
    if ino != inode:
        return None
    name, peer, rq, wq, icons = "", None, 0, 0, ()
    off, end = _HDR.size + _MSG.size, min(length, len(data))
    while off + 4 <= end:
        alen, atype = struct.unpack_from("<HH", data, off)
        if alen < 4:
            break
        body = data[off + 4: off + alen]
        if atype == UNIX_DIAG_NAME:
            name = _name(body)
        elif atype == UNIX_DIAG_PEER and len(body) >= 4:
            peer = struct.unpack_from("<I", body)[0] or None
        elif atype == UNIX_DIAG_RQLEN and len(body) >= 8:
            rq, wq = struct.unpack_from("<II", body)
        elif atype == UNIX_DIAG_ICONS:
            n = min(len(body) // 4, MAX_ICONS)
            icons = tuple(i for i in struct.unpack_from(f"<{n}I", body) if i)
        off += (alen + 3) & ~3
    listening = state == 10
    return UnixSocket(ino, _TYPES.get(typ, str(typ)), _STATES.get(state, str(state)), name, peer,
                      0 if listening else rq, 0 if listening else wq, rq if listening else None, icons)


def _setns_socket(pid: int) -> socket.socket:
    """A netlink socket made inside ``pid``'s network namespace, by a thread that ends after."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    box: list[object] = []

    def enter() -> None:
        try:
            fd = os.open(PROC / str(pid) / "ns" / "net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            box.append(exc)
            return
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                box.append(OSError(err, f"setns into pid {pid}'s network namespace: {os.strerror(err)}"))
                return
            box.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG))
        except OSError as exc:
            box.append(exc)
        finally:
            os.close(fd)

    t = threading.Thread(target=enter, name="hangwatchd-netns", daemon=True)
    t.start()
    t.join(TIMEOUT)
    if not box:
        raise OSError(f"entering pid {pid}'s network namespace did not finish")
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]  # type: ignore[return-value]


class UnixDiag:
    """Questions about Unix sockets in one process's network namespace."""

    def __init__(self, pid: int) -> None:
        self.error: str | None = None
        self._sock: socket.socket | None = None
        self._seq = 0
        try:
            mine = os.stat("/proc/self/ns/net").st_ino
            theirs = os.stat(PROC / str(pid) / "ns" / "net").st_ino
            if mine == theirs:
                self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
            else:
                self._sock = _setns_socket(pid)
            self._sock.settimeout(TIMEOUT)
        except OSError as exc:
            self.error = f"NETLINK_SOCK_DIAG: {exc.strerror or exc}"
            self._sock = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> UnixDiag:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def query(self, inode: int) -> UnixSocket | None:
        """The Unix socket with this inode, None when there is none (or no answer)."""
        if self._sock is None or not 0 < inode < 1 << 32:
            return None
        self._seq += 1
        req = _REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, inode,
                        UDIAG_SHOW_NAME | UDIAG_SHOW_PEER | UDIAG_SHOW_ICONS | UDIAG_SHOW_RQLEN, NOCOOKIE, NOCOOKIE)
        try:
            self._sock.send(_HDR.pack(_HDR.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, self._seq, 0) + req)
            while True:
                data = self._sock.recv(1 << 16)
                if len(data) >= _HDR.size and _HDR.unpack_from(data)[3] == self._seq:
                    break  # an answer to an earlier question that timed out is skipped
        except OSError as exc:
            self.error = f"NETLINK_SOCK_DIAG: {exc.strerror or exc}"
            return None
        if _HDR.unpack_from(data)[1] == NLMSG_ERROR:
            code = -struct.unpack_from("<i", data, _HDR.size)[0]
            if code not in (0, 2):  # ENOENT: no such socket, an answer
                self.error = f"NETLINK_SOCK_DIAG: {os.strerror(code)}"
            return None
        return _parse(data, inode)
