"""Every process that ends on the node, as it ends, with the signal that ended it: the kernel's
process events (the proc connector: ``NETLINK_CONNECTOR``, ``CN_IDX_PROC``).

A hang is often a parent waiting for a worker that is already gone (a ``multiprocessing.Pool``
worker the OOM killer took, a DataLoader worker, an engine-core process that died). By the time
the hang is captured its parent has reaped it and /proc has forgotten it, so exits are recorded
as they happen: a daemon thread reads fork, exec, comm, uid and exit events, keeps who forked
whom (each process gets an id of its own, and carries the ids of its first ``MAX_DEPTH``
ancestors from the moment it was forked, so a pid used again later is another process, and a
child reparented to a subreaper still belongs to the parent that forked it), and keeps the last
``capacity`` exits of whole processes (threads are not counted). ``exits_below(pid, since)``
answers from another thread.

It listens only as root in the host's namespaces: the kernel ignores a subscription from a
container's own PID or user namespace (and before Linux 6.6 wants CAP_NET_ADMIN), and as
another user the daemon keeps to its own processes anyway. Elsewhere ``start`` returns False
and ``off`` says why, in one line.
"""

from __future__ import annotations

import errno
import os
import random
import select
import signal
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("hangwatchd.exits")

NETLINK_CONNECTOR = 11
CN_IDX_PROC = CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE = 1, 2
NLMSG_DONE = 3
# include/uapi/linux/cn_proc.h
EV_NONE, EV_FORK, EV_EXEC, EV_UID, EV_COMM, EV_EXIT = 0, 0x1, 0x2, 0x4, 0x200, 0x80000000
SO_RCVBUFFORCE = 33

CAPACITY = 10_000  # exits kept
MAX_TRACKED = 1 << 18  # live processes whose parentage is kept (the oldest forgotten past it)
MAX_DEPTH = 32  # ancestors a process remembers
MAX_COMM = 16
ACK_TIMEOUT = 1.0
RCVBUF = 8 << 20  # about 10,000 events waiting (the kernel drops the rest, counted in ``lost``)
BATCH = 0.05  # seconds events gather after a wake-up: one wake-up reads many (a storm costs a few wake-ups a second)

_NL = struct.Struct("=IHHII")
_CN = struct.Struct("=IIIIHH")
_EV = struct.Struct("=IIQ")
_HEAD = _NL.size + _CN.size  # 36
_DATA = _HEAD + _EV.size  # 52


@dataclass
class _Proc:
    id: int
    ppid: int | None
    comm: str
    uid: int | None
    lineage: tuple[int, ...]  # the ids of its ancestors, nearest first


@dataclass(frozen=True)
class ProgramStarted:
    """A process below a followed one ran a new program (``ProcExits.follow``): its pid, and the followed one's."""

    pid: int
    root: int


@dataclass(frozen=True)
class Exit:
    pid: int
    ppid: int | None  # the parent that forked it (where known), else its parent when it ended
    comm: str
    uid: int | None  # the effective uid it last ran as, where known
    exit_code: int | None  # the status it exited with; None when a signal ended it
    signal: str | None  # "SIGKILL", when a signal ended it
    core_dumped: bool
    time: float  # epoch seconds
    lineage: tuple[int, ...]

    def record(self, depth: int) -> dict[str, Any]:
        """The exit as exits.json has it; ``depth`` 1 is a child, 2 a grandchild, ..."""
        return {"pid": self.pid, "ppid": self.ppid, "comm": self.comm, "uid": self.uid, "exit_code": self.exit_code,
                "signal": self.signal, "core_dumped": self.core_dumped, "time": round(self.time, 3), "depth": depth}


def signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"SIG{n}"


def _comm_and_owner(pid: int) -> tuple[str, int | None]:
    """The process's name and effective uid, from /proc/PID/comm and its owner (root's for a
    process that is not dumpable: a setuid program, which is then nobody else's); plain os calls,
    as this runs for every exec on the node."""
    try:
        fd = os.open(f"/proc/{pid}/comm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return "", None
    try:
        uid = os.fstat(fd).st_uid
        name = os.read(fd, MAX_COMM + 1)
    except OSError:
        return "", None
    finally:
        os.close(fd)
    return name.decode("utf-8", "replace").strip(), uid


class ProcExits:
    """The listener thread and what it keeps; ``start`` once, ``stop`` once."""

    def __init__(self, capacity: int = CAPACITY, max_tracked: int = MAX_TRACKED, listen: bool = True,
                 on_exec: Callable[[int, int], None] | None = None) -> None:
        """``listen`` False: ``start`` does nothing (nothing asks for exits). ``on_exec(pid, root)``: called
        on this thread when a process below a followed one (``follow``) runs a new program."""
        self.listen = listen
        self.on_exec = on_exec
        self._roots: dict[int, int] = {}  # the id of a followed process -> its pid
        self.capacity = capacity
        self.max_tracked = max_tracked
        self.off: str | None = "not started"
        self.started_at: float | None = None  # epoch: nothing before it is known
        self.lost = 0  # times the kernel dropped events (our queue was full)
        self.events = 0
        self._exits: deque[Exit] = deque(maxlen=capacity)
        self._live: dict[int, _Proc] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._stopping = False
        self._tag = random.randrange(1, 1 << 31)  # the kernel acknowledges with it plus one (its seq is its own)

    @property
    def on(self) -> bool:
        return self.off is None

    # -- start and stop ----------------------------------------------------------------

    def start(self) -> bool:
        """Subscribe and start the thread; False (and ``off``, logged once) where the kernel refuses."""
        if not self.listen:
            self.off = "the exits step is not among capture_steps"
            return False
        if os.geteuid() != 0:
            self.off = f"process exits are recorded only when the daemon runs as root (it runs as uid {os.geteuid()})"
            log.warning("process_exits_off", why=self.off)
            return False
        try:
            self._subscribe()
        except OSError as exc:
            self.off = f"subscribing to the kernel's process events failed ({exc.strerror or exc})"
        if self.off is not None:
            self._close()
        if self.off is not None:
            log.warning("process_exits_off", why=self.off)
            return False
        self.started_at = time.time()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="hangwatchd-exits", daemon=True)
        self._thread.start()
        return True

    def _subscribe(self) -> None:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_CONNECTOR)
        except OSError as exc:
            self.off = f"no kernel process events here (NETLINK_CONNECTOR: {exc.strerror})"
            return
        self._sock = sock
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        try:
            sock.bind((0, CN_IDX_PROC))
        except OSError as exc:
            self.off = (f"the kernel's process events need root (CAP_NET_ADMIN in the host's user namespace): "
                        f"binding to them was refused ({exc.strerror})")
            return
        self._send(PROC_CN_MCAST_LISTEN)
        end = time.monotonic() + ACK_TIMEOUT
        poller = select.poll()  # not select(): a descriptor past 1023 is refused there
        poller.register(sock, select.POLLIN)
        while time.monotonic() < end:
            ready = poller.poll(max(0.0, end - time.monotonic()) * 1000)
            if not ready:
                break
            data = sock.recv(4096)
            ack = self._ack(data)
            if ack is None:
                self._handle(data, time.time() - time.monotonic())  # another listener's events flow already
                continue
            if ack:
                self.off = f"the kernel refused to send process events ({os.strerror(ack)})"
            else:
                self.off = None
            return
        self.off = ("the kernel never answered the subscription to process events: a PID or user namespace of "
                    "its own (a container) gets none; run the daemon in the host's namespaces")

    def _send(self, op: int) -> None:
        assert self._sock is not None
        body = _CN.pack(CN_IDX_PROC, CN_VAL_PROC, 0, self._tag, 4, 0) + struct.pack("=I", op)
        self._sock.send(_NL.pack(_NL.size + len(body), NLMSG_DONE, 0, 0, 0) + body)

    def _ack(self, data: bytes) -> int | None:
        """The error our subscription's acknowledgement carries (0: none), None for any other message."""
        if len(data) < _DATA + 4:
            return None
        ack = _CN.unpack_from(data, _NL.size)[3]
        what = _EV.unpack_from(data, _HEAD)[0]
        if what != EV_NONE or ack != self._tag + 1:
            return None
        return struct.unpack_from("=I", data, _DATA)[0]

    def stop(self) -> None:
        self._stopping = True
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None and self.on:
            try:
                self._send(PROC_CN_MCAST_IGNORE)  # the kernel stops making events once nobody listens
            except OSError:
                pass
        self._close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        sock.setblocking(False)
        buf = bytearray(1 << 12)
        view = memoryview(buf)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        warned = False
        while not self._stopping:
            poller.poll()
            time.sleep(BATCH)
            offset = time.time() - time.monotonic()
            while True:
                try:
                    n = sock.recv_into(buf)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno != errno.ENOBUFS:
                        if not self._stopping:
                            self.off = f"reading process events failed ({exc.strerror})"
                            log.error("process_exits_off", why=self.off)
                        return
                    self.lost += 1  # the kernel dropped events: our queue was full
                    if not warned:
                        log.warning("process_exits_lost", why="events came faster than they were read; some exits are missing")
                        warned = True
                    continue
                self._handle(view[:n], offset)

    def _handle(self, data: bytes | memoryview, offset: float) -> None:
        if len(data) < _DATA:
            return
        what, _cpu, ts = _EV.unpack_from(data, _HEAD)
        self.events += 1
        if what == EV_FORK:
            ppid, ptgid, cpid, ctgid = struct.unpack_from("=iiii", data, _DATA)
            if cpid == ctgid:
                self._forked(ptgid, ctgid)
        elif what == EV_EXIT:
            pid, tgid, code, _sig = struct.unpack_from("=iiII", data, _DATA)
            if pid == tgid:
                parent = struct.unpack_from("=ii", data, _DATA + 16)[1] if len(data) >= _DATA + 24 else 0
                self._exited(tgid, code, parent or None, offset + ts / 1e9)
        elif what == EV_EXEC:
            pid, tgid = struct.unpack_from("=ii", data, _DATA)
            root = None
            with self._lock:
                p = self._live.get(tgid)
                if p is not None:
                    comm, uid = _comm_and_owner(tgid)
                    p.comm, p.uid = comm or p.comm, uid if uid is not None else p.uid
                    root = next((self._roots[i] for i in p.lineage if i in self._roots), None) if self._roots else None
            if root is not None and self.on_exec is not None:
                self.on_exec(tgid, root)
        elif what == EV_COMM:
            pid, tgid = struct.unpack_from("=ii", data, _DATA)
            if pid == tgid:
                name = bytes(data[_DATA + 8: _DATA + 8 + MAX_COMM]).split(b"\0", 1)[0]
                with self._lock:
                    p = self._live.get(tgid)
                    if p is not None:
                        p.comm = name.decode("utf-8", "replace")
        elif what == EV_UID:
            pid, tgid, _ruid, euid = struct.unpack_from("=iiII", data, _DATA)
            if pid == tgid:
                with self._lock:
                    p = self._live.get(tgid)
                    if p is not None:
                        p.uid = euid

    def _known(self, pid: int) -> _Proc:
        """The record of a live process, made from /proc for one that started before we listened."""
        p = self._live.get(pid)
        if p is None:
            self._next += 1
            p = _Proc(self._next, None, *_comm_and_owner(pid), ())
            self._track(pid, p)
        return p

    def _track(self, pid: int, p: _Proc) -> None:
        self._live.pop(pid, None)
        self._live[pid] = p
        while len(self._live) > self.max_tracked:
            del self._live[next(iter(self._live))]

    def _forked(self, ppid: int, pid: int) -> None:
        with self._lock:
            parent = self._known(ppid)
            early = self._live.get(pid)
            if early is not None and early.ppid is None:
                # Asked for (``follow``) between its fork and this event, read from /proc then: the same
                # process, so it keeps the id it was given, now with its parentage.
                ident = early.id
            else:
                self._next += 1
                ident = self._next
            self._track(pid, _Proc(ident, ppid, parent.comm, parent.uid, ((parent.id,) + parent.lineage)[:MAX_DEPTH]))

    def _exited(self, pid: int, code: int, parent: int | None, when: float) -> None:
        with self._lock:
            p = self._live.pop(pid, None)
            if p is None:  # it started before we listened: its parent now is all we know
                up = self._known(parent) if parent and parent > 0 else None
                p = _Proc(0, parent, *_comm_and_owner(pid), ((up.id,) + up.lineage)[:MAX_DEPTH] if up else ())
            killed = code & 0x7F
            self._exits.append(Exit(pid, p.ppid if p.ppid is not None else parent, p.comm, p.uid,
                                    None if killed else code >> 8 & 0xFF, signal_name(killed) if killed else None,
                                    bool(code & 0x80), when, p.lineage))

    # -- following a process's descendants ---------------------------------------------------

    def follow(self, pid: int) -> None:
        """From any thread: ``on_exec`` for every program started below ``pid`` from now on."""
        with self._lock:
            if self.on:
                self._roots[self._known(pid).id] = pid

    def unfollow(self, pid: int) -> None:
        with self._lock:
            self._roots = {i: p for i, p in self._roots.items() if p != pid}

    # -- questions ---------------------------------------------------------------------------

    def exits_below(self, pid: int, since: float) -> list[dict[str, Any]]:
        """The exits since ``since`` (epoch) of processes ``pid`` forked, their children, ... (as
        ``Exit.record``), oldest first; [] for a process that forked nothing while we listened."""
        with self._lock:
            me = self._live.get(pid)
            if me is None:
                return []
            out = []
            for e in self._exits:
                if e.time >= since and me.id in e.lineage:
                    out.append(e.record(e.lineage.index(me.id) + 1))
            return out

    def __len__(self) -> int:
        return len(self._exits)
