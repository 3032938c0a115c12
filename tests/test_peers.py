"""What a thread waits for and who holds the other end, read by the proc step from real processes:
pipes, FIFOs, Unix and TCP sockets, listeners with pending connections, a container's own
network namespace, and processes and descriptors that come and go while the node is scanned."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.capture.proc import ProcStep
from hangwatchd.host import peers, procfs
from hangwatchd.host.blocked_on import blocked_on
from hangwatchd.host.deadline import Deadline
from hangwatchd.model import Registration

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="reads other processes' /proc/PID/syscall: needs root")
pytestmark = needs_root


class Workload:
    """A Python child running ``code``; it prints 'ready' (with anything worth knowing) once set up."""

    def __init__(self, code: str, argv: list[str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen([*(argv or []), sys.executable, "-c", textwrap.dedent(code)],
                                     stdout=subprocess.PIPE, text=True, pass_fds=pass_fds)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        if not ready:
            self.stop()
            raise AssertionError("the workload never said it was ready")
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "ready", line
        self.said = line[1:]
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def start() -> Iterator[Callable[..., Workload]]:
    started: list[Workload] = []

    def run(code: str, **kw: Any) -> Workload:
        w = Workload(code, **kw)
        started.append(w)
        return w

    yield run
    for w in started:
        w.stop()


SLEEPS = ("clock_nanosleep", "nanosleep", "select", "pselect6")  # time.sleep, as the kernel shows it


def until_blocked(pid: int, syscall: str | tuple[str, ...], tid: int | None = None, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    wanted = (syscall,) if isinstance(syscall, str) else syscall
    while time.monotonic() < end:
        tids = [tid] if tid else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        if any(blocked_on(pid, t).get("syscall") in wanted for t in tids):
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never blocked in {syscall}")


def until_closed(pid: int, fd: int, timeout: float = 10.0) -> None:
    """Wait until a forked child has closed its copy of ``fd``: it does so after the parent said ready."""
    end = time.monotonic() + timeout
    while os.path.lexists(f"/proc/{pid}/fd/{fd}"):
        if time.monotonic() > end:
            raise AssertionError(f"pid {pid} never closed fd {fd}")
        time.sleep(0.02)


def proc_json(pid: int, out: Path) -> dict[str, Any]:
    ident = procfs.identify(pid)
    assert ident is not None
    out.mkdir(parents=True, exist_ok=True)
    files = ProcStep().run(Registration(process=ident, uid=0), out, Deadline.after(5.0))
    assert files == ("proc.json",)
    return json.loads((out / "proc.json").read_text())


def thread_wait(data: dict[str, Any], syscall: str) -> dict[str, Any]:
    waits = [t["blocked_on"] for t in data["threads"] if (t.get("blocked_on") or {}).get("syscall") == syscall]
    assert len(waits) == 1, [t.get("blocked_on") for t in data["threads"]]
    return waits[0]


# -- pipes and FIFOs -----------------------------------------------------------------------


def test_a_thread_reading_a_pipe_its_own_process_writes_names_that_descriptor(start: Callable[..., Workload], tmp_path: Path) -> None:
    w = start("""
        import os, threading, time
        r, w = os.pipe()
        threading.Thread(target=os.read, args=(r, 1), name="reader", daemon=True).start()
        print("ready", r, w, flush=True)
        time.sleep(600)
    """)
    r, wfd = map(int, w.said)
    until_blocked(w.pid, "read")
    until_blocked(w.pid, SLEEPS, tid=w.pid)  # the main thread prints before it sleeps
    data = proc_json(w.pid, tmp_path)
    wait = thread_wait(data, "read")
    assert wait["kind"] == "pipe" and wait["fd"] == r
    assert wait["peers_complete"] is True
    assert [(p["pid"], p["fd"], p["mode"], p["same_process"]) for p in wait["peers"]] == [(w.pid, wfd, "w", True)]
    # The main thread sleeps: its own wait, and no peers to name.
    assert data["blocked_on"]["syscall"] in SLEEPS
    assert data["schedstat"]["cpu_ns"] > 0 and data["schedstat"]["slices"] > 0


def test_the_child_that_holds_the_write_end_is_named_by_its_pid(start: Callable[..., Workload], tmp_path: Path) -> None:
    w = start("""
        import os, sys, time
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(r)
            time.sleep(600)
            os._exit(0)
        os.close(w)
        print("ready", child, r, w, flush=True)
        os.read(r, 1)
    """)
    child, r, wfd = map(int, w.said)
    try:
        until_closed(child, r)
        until_blocked(w.pid, "read")
        wait = proc_json(w.pid, tmp_path)["blocked_on"]
        assert wait["fd"] == r and wait["kind"] == "pipe"
        assert [(p["pid"], p["fd"], p["mode"], p["same_process"], p["uid"]) for p in wait["peers"]] == [(child, wfd, "w", False, 0)]
        assert wait["peers"][0]["comm"].startswith("python"), wait["peers"]
    finally:
        os.kill(child, 9)


def test_an_open_of_a_fifo_nobody_writes_names_the_fifo_and_its_readers(start: Callable[..., Workload], tmp_path: Path) -> None:
    fifo = tmp_path / "jobs.fifo"
    os.mkfifo(fifo)
    w = start(f"""
        import os, threading, time
        def opener():
            open({str(fifo)!r}, "rb")
        threading.Thread(target=opener, daemon=True).start()
        print("ready", flush=True)
        time.sleep(600)
    """)
    until_blocked(w.pid, "openat")
    wait = thread_wait(proc_json(w.pid, tmp_path / "out"), "openat")
    assert wait["kind"] == "FIFO" and wait["mode"] == "r" and wait["path"] == str(fifo), wait
    assert wait["peers"] == [] and wait["peers_complete"] is True
    assert wait["text"] == f"opening FIFO {fifo} for reading: no process has it open for writing"


def test_a_read_of_a_fifo_names_the_process_that_holds_it_for_writing(start: Callable[..., Workload], tmp_path: Path) -> None:
    fifo, go = tmp_path / "q.fifo", tmp_path / "go"
    os.mkfifo(fifo)
    reader = start(f"""
        import os, time
        fd = os.open({str(fifo)!r}, os.O_RDONLY | os.O_NONBLOCK)
        print("ready", fd, flush=True)
        while not os.path.exists({str(go)!r}):  # a read before any writer came would be an end of file
            time.sleep(0.01)
        os.set_blocking(fd, True)
        os.read(fd, 1)
    """)
    writer = start(f"""
        import os, time
        fd = os.open({str(fifo)!r}, os.O_WRONLY)
        print("ready", fd, flush=True)
        time.sleep(600)
    """)
    go.touch()
    until_blocked(reader.pid, "read")
    wait = proc_json(reader.pid, tmp_path / "out")["blocked_on"]
    assert wait["kind"] == "FIFO" and wait["path"] == str(fifo)
    assert [(p["pid"], p["fd"], p["mode"]) for p in wait["peers"]] == [(writer.pid, int(writer.said[0]), "w")]


# -- sockets -------------------------------------------------------------------------------


def test_a_recv_on_a_socketpair_names_the_process_at_the_other_end(start: Callable[..., Workload], tmp_path: Path) -> None:
    w = start("""
        import os, socket, time
        a, b = socket.socketpair()
        child = os.fork()
        if child == 0:
            a.close()
            time.sleep(600)
            os._exit(0)
        b.close()
        print("ready", child, a.fileno(), flush=True)
        a.recv(1)
    """)
    child, fd = map(int, w.said)
    try:
        until_closed(child, fd)
        until_blocked(w.pid, "recvfrom")
        wait = proc_json(w.pid, tmp_path)["blocked_on"]
        assert wait["fd"] == fd and wait["kind"] == "socket"
        s = wait["socket"]
        assert (s["family"], s["type"], s["state"], s["rx_queue"]) == ("unix", "stream", "ESTABLISHED", 0)
        assert s["peer_inode"] and s["peer_inode"] != wait["object"][1]
        assert [(p["pid"], p["same_process"], p["mode"]) for p in wait["peers"]] == [(child, False, "rw")]
    finally:
        os.kill(child, 9)


def test_a_tcp_client_whose_server_accepted_and_never_answers(start: Callable[..., Workload], tmp_path: Path) -> None:
    server = start("""
        import socket, time
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
        print("ready", s.getsockname()[1], flush=True)
        conn, _ = s.accept()
        print("accepted", conn.fileno(), flush=True)
        time.sleep(600)
    """)
    port = int(server.said[0])
    client = start(f"""
        import socket
        c = socket.create_connection(("127.0.0.1", {port}))
        c.sendall(b"GET")
        print("ready", c.fileno(), c.getsockname()[1], flush=True)
        c.recv(1)
    """)
    assert server.proc.stdout is not None
    accepted = int(server.proc.stdout.readline().split()[1])
    until_blocked(client.pid, "recvfrom")
    data = proc_json(client.pid, tmp_path / "client")
    s = data["blocked_on"]["socket"]
    assert (s["family"], s["state"], s["rx_queue"]) == ("tcp", "ESTABLISHED", 0)
    assert s["remote"] == f"127.0.0.1:{port}" and s["local"] == f"127.0.0.1:{client.said[1]}"
    assert [(p["pid"], p["fd"]) for p in data["blocked_on"]["peers"]] == [(server.pid, accepted)]
    assert data["io"]["unread"] == [] and data["io"]["listening"] == []
    # The server's side: the request it never read is unread there.
    sdata = proc_json(server.pid, tmp_path / "server")
    assert {"fd": accepted, "kind": "tcp", "rx_queue": 3} in sdata["io"]["unread"]


@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_a_listener_that_never_accepts_shows_its_pending_connections(start: Callable[..., Workload], tmp_path: Path, family: str) -> None:
    path = str(tmp_path / "srv.sock")
    server = start(f"""
        import socket, time
        if {family!r} == "tcp":
            s = socket.socket(); s.bind(("127.0.0.1", 0)); name = "127.0.0.1:%d" % s.getsockname()[1]
        else:
            s = socket.socket(socket.AF_UNIX); s.bind({path!r}); name = {path!r}
        s.listen(16)
        print("ready", s.fileno(), name, flush=True)
        time.sleep(600)
    """)
    fd, name = int(server.said[0]), server.said[1]
    clients = []
    for _ in range(3):
        if family == "tcp":
            c = socket.create_connection(("127.0.0.1", int(name.rsplit(":", 1)[1])))
        else:
            c = socket.socket(socket.AF_UNIX)
            c.connect(path)
        clients.append(c)
    try:
        data = proc_json(server.pid, tmp_path / "out")
        assert data["io"]["listening"] == [{"fd": fd, "local": name, "backlog": 3}]
        assert data["io"]["unread"] == []
    finally:
        for c in clients:
            c.close()


def test_a_connect_to_a_full_listener_names_the_address_and_the_server(start: Callable[..., Workload], tmp_path: Path) -> None:
    path = str(tmp_path / "full.sock")
    server = start(f"""
        import socket, time
        s = socket.socket(socket.AF_UNIX); s.bind({path!r}); s.listen(0)
        print("ready", s.fileno(), flush=True)
        time.sleep(600)
    """)
    client = start(f"""
        import socket
        first = socket.socket(socket.AF_UNIX); first.connect({path!r})  # fills the queue
        print("ready", flush=True)
        socket.socket(socket.AF_UNIX).connect({path!r})
    """)
    until_blocked(client.pid, "connect")
    wait = proc_json(client.pid, tmp_path / "out")["blocked_on"]
    assert wait["connect_to"] == path and wait["text"].endswith(f" to {path}")
    assert [(p["pid"], p["fd"]) for p in wait["peers"]] == [(server.pid, int(server.said[0]))]


def test_an_idle_server_waiting_in_accept_has_no_work_waiting(start: Callable[..., Workload], tmp_path: Path) -> None:
    server = start("""
        import socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
        print("ready", s.fileno(), s.getsockname()[1], flush=True)
        s.accept()
    """)
    until_blocked(server.pid, "accept4")
    data = proc_json(server.pid, tmp_path)
    wait = data["blocked_on"]
    assert wait["socket"]["state"] == "LISTEN" and wait["socket"]["backlog"] == 0
    assert data["io"] == {"listening": [{"fd": int(server.said[0]), "local": f"127.0.0.1:{server.said[1]}", "backlog": 0}],
                          "unread": [], "sockets": 1, "complete": True}


def test_an_epoll_wait_lists_exactly_the_set_it_waits_on(start: Callable[..., Workload], tmp_path: Path) -> None:
    w = start("""
        import os, select, socket
        a, b = socket.socketpair()
        r, w = os.pipe()
        other_r, other_w = os.pipe()  # held, never waited on
        ep = select.epoll()
        ep.register(a.fileno(), select.EPOLLIN)
        ep.register(w, select.EPOLLOUT)
        os.write(w, b"x" * 65536)  # full: EPOLLOUT waits
        print("ready", a.fileno(), w, flush=True)
        ep.poll()
    """)
    sock_fd, pipe_w = map(int, w.said)
    until_blocked(w.pid, "epoll_wait")
    wait = proc_json(w.pid, tmp_path)["blocked_on"]
    assert wait["fds_from"] == "epoll" and wait["fds_total"] == 2
    got = {d["fd"]: d for d in wait["fds"]}
    assert set(got) == {sock_fd, pipe_w}
    assert got[sock_fd]["wants"] == "r" and got[sock_fd]["socket"]["family"] == "unix"
    assert [p["same_process"] for p in got[sock_fd]["peers"]] == [True]  # b, in the same process
    assert got[pipe_w]["wants"] == "w" and [p["mode"] for p in got[pipe_w]["peers"]] == ["r"]


def test_a_poll_lists_its_array_and_what_it_waits_for_on_each(start: Callable[..., Workload], tmp_path: Path) -> None:
    w = start("""
        import os, select
        r, w = os.pipe()
        p = select.poll()
        p.register(r, select.POLLIN)
        print("ready", r, flush=True)
        p.poll()
    """)
    until_blocked(w.pid, "poll")
    wait = proc_json(w.pid, tmp_path)["blocked_on"]
    assert wait["fds_from"] == "poll" and [(d["fd"], d["wants"], d["kind"]) for d in wait["fds"]] == [(int(w.said[0]), "r", "pipe")]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) to make a network namespace")
def test_a_socketpair_inside_a_containers_own_network_namespace_finds_its_peer(start: Callable[..., Workload], tmp_path: Path) -> None:
    w = start("""
        import os, socket, time
        a, b = socket.socketpair()
        child = os.fork()
        if child == 0:
            a.close(); time.sleep(600); os._exit(0)
        b.close()
        print("ready", child, a.fileno(), flush=True)
        a.recv(1)
    """, argv=["unshare", "--net"])
    child, fd = map(int, w.said)
    try:
        until_closed(child, fd)
        assert os.stat(f"/proc/{w.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
        until_blocked(w.pid, "recvfrom")
        wait = proc_json(w.pid, tmp_path)["blocked_on"]
        assert wait["socket"]["family"] == "unix" and wait["socket"]["peer_inode"], wait
        assert [p["pid"] for p in wait["peers"]] == [child]
        assert os.stat("/proc/self/ns/net").st_ino == os.stat(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net").st_ino
    finally:
        os.kill(child, 9)


# -- robustness ------------------------------------------------------------------------------


def test_processes_that_vanish_while_the_node_is_scanned_are_skipped(start: Callable[..., Workload], tmp_path: Path) -> None:
    """A storm of short-lived processes holding pipes, while the node is scanned again and again."""
    stop = threading.Event()

    def storm() -> None:
        while not stop.is_set():
            kids = [subprocess.Popen(["sleep", "0.01"], stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(8)]
            for k in kids:
                k.communicate()

    w = start("""
        import os, threading
        r, w = os.pipe()
        print("ready", r, w, flush=True)
        os.read(r, 1)
    """)
    until_blocked(w.pid, "read")
    t = threading.Thread(target=storm)
    t.start()
    try:
        for i in range(15):
            snap = peers.scan(time.monotonic() + 5)
            assert snap.complete
            data = proc_json(w.pid, tmp_path / str(i))
            assert [(p["pid"], p["mode"]) for p in data["blocked_on"]["peers"]] == [(w.pid, "w")]
    finally:
        stop.set()
        t.join()


def test_descriptors_closed_while_they_are_read_never_break_the_step(start: Callable[..., Workload], tmp_path: Path) -> None:
    w = start("""
        import os, socket, threading, select
        r, w = os.pipe()
        def churn():
            while True:
                a, b = socket.socketpair(); p, q = os.pipe()
                s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
                for x in (a, b, s):
                    x.close()
                os.close(p); os.close(q)
        for _ in range(2):
            threading.Thread(target=churn, daemon=True).start()
        ep = select.epoll(); ep.register(r, select.EPOLLIN)
        threading.Thread(target=ep.poll, daemon=True).start()
        print("ready", flush=True)
        os.read(r, 1)
    """)
    until_blocked(w.pid, "read")
    for i in range(30):
        data = proc_json(w.pid, tmp_path / str(i))
        assert data["blocked_on"]["kind"] == "pipe"
        assert isinstance(data["io"]["listening"], list)
        for t in data["threads"]:
            assert t["state"] == "R" or "blocked_on" in t or not data["waits_complete"]


def test_a_process_gone_before_its_waits_are_read_gives_no_error() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with peers.Looker(time.monotonic() + 1) as looker:
        w = blocked_on(p.pid)
        looker.annotate(p.pid, w)
        assert looker.io(p.pid, {}) == {"listening": [], "unread": [], "sockets": 0, "complete": True}
    assert procfs.schedstat(p.pid) is None


def test_a_scan_past_its_deadline_says_it_is_incomplete() -> None:
    snap = peers.scan(time.monotonic() - 1)
    assert snap.complete is False
    with peers.Looker(time.monotonic() - 1) as looker:
        d = {"kind": "pipe", "fd": 0, "path": "pipe:[1]"}
        looker.annotate(os.getpid(), d)
        assert d["peers"] == [] and d["peers_complete"] is False


def test_a_socket_of_this_process_is_described_from_the_kernel() -> None:
    """The pieces alone: a Unix socket's queue and peer from sock_diag, a UDP socket's table row."""
    a, b = socket.socketpair()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("127.0.0.1", 0))
    try:
        b.send(b"12345")
        with peers.Looker(time.monotonic() + 2) as looker:
            info, others = looker.socket(os.getpid(), a.fileno(), os.fstat(a.fileno()).st_ino)
            assert (info["rx_queue"], info["peer_inode"]) == (5, os.fstat(b.fileno()).st_ino) and others == [info["peer_inode"]]
            info, others = looker.socket(os.getpid(), u.fileno(), os.fstat(u.fileno()).st_ino)
            assert (info["family"], info["state"], info["local"], others) == ("udp", "UNCONN", f"127.0.0.1:{u.getsockname()[1]}", [])
    finally:
        for s in (a, b, u):
            s.close()
