"""NCCL's own view of the job: ask its RAS service, keep the answer as nccl-ras.txt (and nccl-ras.json).

Every NCCL 2.24+ process runs a RAS service; the processes of a job form a
ring, so any one of them answers for the whole job, across nodes: which
ranks are alive, missing or dead, and how many collectives each launched.
It listens on ``NCCL_RAS_ADDR`` (``hangwatchd run`` gives each job its own),
by default ``localhost:28028``. The exchange is a few text lines:
``CLIENT PROTOCOL 2`` / ``SERVER PROTOCOL n``, ``TIMEOUT s`` / ``OK``,
optionally ``SET FORMAT json`` / ``OK``, then ``VERBOSE STATUS``, after which
the service writes its report and closes the connection.

Ranks of one job on one node share the service: it is asked once per
incident and address, and each rank's directory gets a copy. A port nobody
listens on is a job without NCCL (or with RAS off): the step reads n/a.
Whatever answers is untrusted: the answer is capped and read to a deadline.

The port is no secret (it is in the world-readable registration), so anyone on
the node could listen there first. Before a word of the answer is used, the
process at the other end of our connection is found (the accepting socket's
inode in /proc/net/tcp{,6}, then the process that holds it in /proc/PID/fd)
and must be one of the job's: of the captured process's uid, and the process
itself, one of its ancestors (the job's launcher), or a process that runs in
the same job (same HANGWATCHD_JOB or NCCL_RAS_ADDR in its environment).
Another user's listener is refused, and the step says so in the incident.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..host import procfs
from ..host.deadline import Deadline
from ..model import Registration
from .base import Phase, StepFailed, StepNotApplicable

DEFAULT_ADDR = "localhost:28028"
PROTOCOL = 2
MAX_ANSWER = 16 << 20


@dataclass(frozen=True)
class Answer:
    text: bytes | None
    json: bytes | None
    error: str | None  # why there is no text answer
    seconds: float
    refused: bool = False  # someone answered who is not of the job: said in the incident, as a failed step


def address_of(env: dict[str, str], registered: str | None = None) -> str:
    """Where the job's RAS listens: its environment (what NCCL reads), else what was registered, else the default."""
    return env.get("NCCL_RAS_ADDR") or registered or DEFAULT_ADDR


def split_address(addr: str) -> tuple[str, int]:
    """("host", port) from "host:port", "[v6]:port" or ":port"; ValueError if it is none of those."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{addr!r} is not host:port")
    host = host.strip("[]") or "localhost"
    return host, int(port)


def local_host(host: str) -> bool:
    """Is ``host`` this node (loopback, or one of its host name's addresses)?

    NCCL_RAS_ADDR is where the process itself listens, so it is local. The
    environment is the user's: a remote address there would make root connect
    wherever the user likes, so it is refused; and a name other than this
    host's would need DNS, which has no deadline.
    """
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    try:
        return str(ip) in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


class NotTheJobs(ConnectionError):
    """The RAS port answered, but from a process that is not one of the job's."""


def _hex_addr(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of /proc/net/tcp{,6}: hex, each 32-bit word in host (little-endian) order."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words), int(port, 16)


def _same(a: ipaddress.IPv4Address | ipaddress.IPv6Address, b: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    def v4(x: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        return x.ipv4_mapped or x if isinstance(x, ipaddress.IPv6Address) else x
    return v4(a) == v4(b)


def server_socket(sock: socket.socket) -> tuple[int, int] | None:
    """(inode, uid) of the socket at the far end of ``sock``, a connection on this node: the
    entry of /proc/net/tcp{,6} whose local end is our peer and whose remote end is us."""
    me_host, me_port = sock.getsockname()[:2]
    peer_host, peer_port = sock.getpeername()[:2]
    me, peer = ipaddress.ip_address(me_host.split("%")[0]), ipaddress.ip_address(peer_host.split("%")[0])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10:
                continue
            try:
                (lh, lp), (rh, rp) = _hex_addr(f[1]), _hex_addr(f[2])
            except ValueError:
                continue
            if lp == peer_port and rp == me_port and _same(lh, peer) and _same(rh, me) and f[9] != "0":
                return int(f[9]), int(f[7])
    return None


def holder_of(inode: int, uid: int, first: list[int], end: float) -> int | None:
    """The pid of a process of ``uid`` holding socket ``inode``. The likely ones are looked at
    first (``first``: the captured process, its ancestors, the last holder found; then the
    children of those ancestors, a job's other ranks), then every other process of ``uid``."""
    link = f"socket:[{inode}]"

    def holds(pid: int) -> bool:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return False
        for fd in fds:
            try:  # one fd closed since the listing (any busy process) says nothing of the others
                if os.readlink(f"/proc/{pid}/fd/{fd}") == link:
                    return True
            except OSError:
                continue
        return False

    for pid in first:
        if holds(pid):
            return pid
    near: list[int] = []
    rest: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            raw = open(f"/proc/{name}/stat", "rb").read()
            ppid = int(raw[raw.rfind(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        (near if ppid in first else rest).append(int(name))
    for pid in near + rest:
        if time.monotonic() > end:
            return None
        if holds(pid):
            return pid
    return None


JOB_KEYS = frozenset({"HANGWATCHD_JOB", "NCCL_RAS_ADDR"})


def _ancestors(pid: int, depth: int = 64) -> set[int]:
    out: set[int] = set()
    while pid > 1 and len(out) < depth:
        try:
            raw = open(f"/proc/{pid}/stat", "rb").read()
            pid = int(raw[raw.rfind(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
        out.add(pid)
    return out


def job_check(target: Registration, end: float) -> Callable[[socket.socket], None]:
    """A check of the far end of a connection: one of ``target``'s job's processes, else NotTheJobs."""
    pid = target.process.pid
    uid = target.uid
    mine = {k: v for k, v in procfs.environ(pid, JOB_KEYS).items() if v}
    found_before: list[int] = []

    def check(sock: socket.socket) -> None:
        found = server_socket(sock)
        if found is None:
            raise NotTheJobs("the listening process could not be found in /proc/net/tcp: its answer is not used")
        inode, sock_uid = found
        if uid is not None and sock_uid != uid:
            raise NotTheJobs(f"the process listening there runs as uid {sock_uid}, not the job's uid {uid}: "
                             "its answer is not used")
        holder = holder_of(inode, sock_uid, [*found_before, pid, *_ancestors(pid)], end)
        if holder is None:
            raise NotTheJobs("no process of the job's user holds the listening socket: its answer is not used")
        found_before[:] = [holder]  # the JSON query's connection is most likely accepted by the same process
        if holder == pid or holder in _ancestors(pid):
            return
        theirs = {k: v for k, v in procfs.environ(holder, JOB_KEYS).items() if v}
        if not mine or not any(theirs.get(k) == v for k, v in mine.items()):
            raise NotTheJobs(f"pid {holder}, which listens there, is not of this job (no matching HANGWATCHD_JOB "
                             "or NCCL_RAS_ADDR): its answer is not used")
    return check


def _read_line(sock: socket.socket, end: float) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError("no reply in time")
        sock.settimeout(left)
        chunk = sock.recv(1024)
        if not chunk:
            raise ConnectionError("the service closed the connection")
        buf += chunk
        if len(buf) > 4096:
            raise ConnectionError("a reply line longer than 4 KB: not a RAS service")
    return buf


def _exchange(sock: socket.socket, line: str, expect: str, end: float) -> str:
    sock.settimeout(max(end - time.monotonic(), 0.001))
    sock.sendall(line.encode() + b"\n")
    reply = _read_line(sock, end).decode("utf-8", "replace").strip()
    if not reply.upper().startswith(expect):
        raise ConnectionError(f"answered {reply[:80]!r} to {line!r}")
    return reply


def query(addr: str, timeout: float, fmt: str = "text", check: Callable[[socket.socket], None] | None = None) -> bytes:
    """One ``VERBOSE STATUS`` from the RAS service at ``addr``, whole, within ``timeout`` seconds.
    ``check`` vets the process at the far end once it has accepted (before its report is read).

    Raises OSError (refused, reset, unreachable), TimeoutError or ConnectionError
    (a peer that does not speak the protocol; NotTheJobs from ``check``), ValueError (a bad address)."""
    end = time.monotonic() + timeout
    host, port = split_address(addr)
    if not local_host(host):
        raise ValueError(f"{addr!r} is not an address of this node; only a local RAS service is asked")
    with socket.create_connection((host, port), timeout=max(timeout, 0.001)) as sock:
        _exchange(sock, f"CLIENT PROTOCOL {PROTOCOL}", "SERVER PROTOCOL", end)
        if check is not None:  # it has accepted (it answered): the accepting socket has its owner now
            check(sock)
        # How long NCCL may wait for the other processes of the job: half of what is left,
        # so that a slow leg still leaves it time to write what it has.
        _exchange(sock, f"TIMEOUT {max(1, int((end - time.monotonic()) / 2))}", "OK", end)
        if fmt != "text":
            _exchange(sock, f"SET FORMAT {fmt}", "OK", end)
        sock.sendall(b"VERBOSE STATUS\n")
        chunks: list[bytes] = []
        size = 0
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the report was not finished within {timeout:g} s")
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_ANSWER:
                raise ConnectionError(f"an answer larger than {MAX_ANSWER >> 20} MB: not a RAS report")


def ask(addr: str, timeout: float, check: Callable[[socket.socket], None] | None = None) -> Answer:
    """The text report and, where the service speaks it (NCCL 2.27+), the JSON one; never raises."""
    start = time.monotonic()
    end = start + timeout
    try:
        text = query(addr, timeout, check=check)
    except NotTheJobs as exc:
        return Answer(None, None, f"{addr}: {exc}", time.monotonic() - start, refused=True)
    except ValueError as exc:
        return Answer(None, None, f"NCCL_RAS_ADDR {exc}", time.monotonic() - start)
    except ConnectionRefusedError:
        return Answer(None, None, f"nothing listens on {addr} (no NCCL in the job, or NCCL_RAS_ENABLE=0)",
                      time.monotonic() - start)
    except (TimeoutError, socket.timeout):
        return Answer(None, None, f"{addr} did not answer within {timeout:g} s", time.monotonic() - start)
    except (OSError, ConnectionError) as exc:
        return Answer(None, None, f"{addr}: {exc}", time.monotonic() - start)
    js = None
    left = end - time.monotonic()
    if left > 0.05:
        try:
            js = query(addr, left, "json", check=check)
        except (OSError, ConnectionError, ValueError):
            js = None  # an NCCL before 2.27 speaks text only; the text has the facts
    return Answer(text, js, None, time.monotonic() - start)


@dataclass
class NcclRasStep:
    name: str = "nccl_ras"
    phase: ClassVar[Phase] = Phase.BESIDE  # it asks NCCL's RAS service over TCP, never the process: beside the other steps
    # (incident directory, address) -> the answer; every rank of the incident gets the same one.
    _answers: OrderedDict[tuple[str, str], Answer] = field(default_factory=OrderedDict)
    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        env = procfs.environ(target.process.pid, frozenset({"NCCL_RAS_ADDR", "NCCL_RAS_ENABLE"}))
        if env.get("NCCL_RAS_ENABLE") == "0":
            raise StepNotApplicable("NCCL_RAS_ENABLE=0 in the process's environment")
        addr = address_of(env, target.ras_addr)
        answer = self._answer(str(outdir.parent), addr, deadline.left(), job_check(target, deadline.at))
        if answer.refused:
            raise StepFailed(answer.error or "refused")
        if answer.error:
            raise StepNotApplicable(answer.error)
        files = []
        if answer.text is not None:
            (outdir / "nccl-ras.txt").write_bytes(answer.text)
            files.append("nccl-ras.txt")
        if answer.json:
            (outdir / "nccl-ras.json").write_bytes(answer.json)  # as NCCL wrote it; the reader mends 2.28.9's
            files.append("nccl-ras.json")
        return tuple(files)

    def _answer(self, incident: str, addr: str, timeout: float, check: Callable[[socket.socket], None] | None = None) -> Answer:
        key = (incident, addr)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # a second rank of the same job waits for the first one's answer
            with self._guard:
                found = self._answers.get(key)
            if found is None:
                found = ask(addr, timeout, check)
                with self._guard:
                    self._answers[key] = found
                    while len(self._answers) > 64:  # incidents long stored: forget their answers
                        old, _ = self._answers.popitem(last=False)
                        self._locks.pop(old, None)
            return found
