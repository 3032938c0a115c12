"""Watching without code changes: frozen stacks, discovery, learned timeouts, sd_notify."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from hangwatchd.testing import ScratchDaemon, stop, wait_for

from .conftest import hangwatchd

FAST = {"stack_interval": 0.5, "stack_window": 3.0, "pyspy_native": False, "gpu_dump": "never"}



def python(code: str, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], **kw)  # type: ignore[call-overload]  # **kw holds Popen's own keywords


def test_discovery_finds_a_gpu_process_that_never_imports_hangwatchd_and_catches_its_deadlock(tmp_path: Path, fake_gpu: Path) -> None:
    code = (f"import threading, time\nf = open({str(fake_gpu)!r})\n"
            "for i in range(20): time.sleep(0.05)\n"
            "lock = threading.Lock(); lock.acquire()\n"
            "def stuck_on_lock():\n    lock.acquire()\nstuck_on_lock()\n")
    with ScratchDaemon(tmp_path, config={**FAST, "discover": True, "rescan_interval": 0.5}) as d:
        work = python(code)
        try:
            (inc,) = wait_for(d.settled, 30, "a stack incident")
            assert inc["reason"] == "stack" and inc["processes"] == [work.pid]
            assert "blocked in" in inc["summary"] and "same stack" in inc["summary"]
            data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
            assert data["signals"] == ["stack"]
            shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir)).stdout
            assert "stuck_on_lock" in shown
            assert d.metric("hangwatchd_hangs_total", reason="stack") == 1.0
            st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
            assert [p["source"] for p in st["processes"]] == ["discovered"]
        finally:
            stop(work, sig=signal.SIGKILL)


def test_healthy_and_idle_processes_raise_nothing_under_sampling(tmp_path: Path, fake_gpu: Path) -> None:
    busy = (f"import time\nf = open({str(fake_gpu)!r})\n"
            "def work(n):\n    return sum(i * i for i in range(n))\n"
            "while True:\n    for n in range(1, 4000): work(n)\n")
    idle = (f"import selectors, socket\nf = open({str(fake_gpu)!r})\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "sel = selectors.DefaultSelector(); sel.register(s, selectors.EVENT_READ)\n"
            "def serve_forever():\n    while True: sel.select()\nserve_forever()\n")
    with ScratchDaemon(tmp_path, config={**FAST, "discover": True, "rescan_interval": 0.5}) as d:
        procs = [python(busy), python(idle)]
        try:
            wait_for(lambda: len(json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)["processes"]) == 2,
                     10, "both discovered")
            d.looked(2, after=time.time() + 10)  # twice the stack timeout, and the loop looked again since
            assert d.store().list() == []
            # The idle one was seen and let be: it waits where servers wait for work (undeclared, that is
            # enough; see the declared test below for the sockets' word).
            assert any(e.get("pid") == procs[1].pid and (e.get("event") == "stack_frozen_idle" or (
                e.get("event") == "stack_frozen_working" and str(e.get("why")).startswith("idle:"))) for e in d.logs())
        finally:
            for p in procs:
                stop(p, sig=signal.SIGKILL)


def test_a_declared_stack_timeout_catches_a_process_that_merely_stopped_moving(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config=FAST) as d:
        work = d.run([sys.executable, "-c", "import time\ndef poll_forever():\n    while True: time.sleep(0.2)\npoll_forever()"],
                     "--stack-timeout", "2", "--heartbeat-timeout", "3600")
        try:
            (inc,) = wait_for(d.settled, 30, "a stack incident")
            assert inc["reason"] == "stack" and "declared --stack-timeout" in inc["summary"]
        finally:
            stop(work, sig=signal.SIGKILL)


SERVER = """
import os, selectors, socket, sys, threading
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(16)
print(s.getsockname()[1], os.getpid(), flush=True)
def serve_forever():
    sel = selectors.DefaultSelector(); sel.register(s, selectors.EVENT_READ)
    while True:
        sel.select()
        conn, _ = s.accept()
        handle(conn)
model_lock = threading.Lock()
model_lock.acquire()  # as if a request before had left it taken
def handle(conn):
    with model_lock:
        conn.sendall(b"ok")
serve_forever()
"""


def test_a_declared_server_with_nothing_waiting_is_idle_and_with_requests_waiting_is_hung(tmp_path: Path) -> None:
    """Both servers keep one stack: the quiet one waits in select with an empty backlog and is let
    be; the other's handler waits for a lock while requests queue behind it: hung, and the incident
    says how many wait."""
    import socket
    with ScratchDaemon(tmp_path, config=FAST) as d:
        quiet, stuck = (d.run([sys.executable, "-c", SERVER], "--stack-timeout", "2", "--heartbeat-timeout", "3600",
                              stdout=subprocess.PIPE) for _ in range(2))
        clients = []
        try:
            assert quiet.stdout is not None and stuck.stdout is not None
            (quiet_port, quiet_pid), (port, stuck_pid) = (map(int, p.stdout.readline().split()) for p in (quiet, stuck)
                                                          if p.stdout is not None)
            assert quiet_port != port
            for _ in range(4):  # the first is accepted and stuck in handle(); three wait in the backlog
                clients.append(socket.create_connection(("127.0.0.1", port)))
            (inc,) = wait_for(d.settled, 30, "the stuck server's incident")
            assert inc["processes"] == [stuck_pid] and "3 connections waiting to be accepted" in inc["summary"]
            d.looked(2, after=time.time() + 4)  # the quiet one held still for twice its timeout
            assert [i["processes"] for i in d.store().list()] == [[stuck_pid]]
            assert any(e.get("event") == "stack_frozen_working" and e.get("pid") == quiet_pid
                       and str(e.get("why")).startswith("idle: it waits for work and has none") for e in d.logs())
        finally:
            for c in clients:
                c.close()
            for p in (quiet, stuck):
                stop(p, sig=signal.SIGKILL)


POLL = """
import os, selectors, sys, threading, time, hangwatchd
quiet, stop_beating, how = os.pipe()[0], sys.argv[1], sys.argv[2]
def beat_aside():
    while True:
        hangwatchd.beat(); time.sleep(0.3)
def poll_forever():
    sel = selectors.DefaultSelector(); sel.register(quiet, selectors.EVENT_READ)
    while True:
        sel.select(0.3)
        if how == "from its loop" and not os.path.exists(stop_beating):
            hangwatchd.beat()
if how == "from a side thread":
    threading.Thread(target=beat_aside, name="heartbeat", daemon=True).start()
poll_forever()
"""


def test_a_loop_that_beats_between_polls_is_not_hung_by_its_still_stack_and_a_side_thread_s_beats_excuse_nothing(
        tmp_path: Path) -> None:
    """Two pollers under --stack-timeout, each always in select when sampled. One beats from its loop:
    its beats prove the loop turns, so it is let be, until it stops beating. The other's beats come
    from a side thread while its main thread polls a pipe nobody writes: they prove nothing of the
    main thread, and it is hung (a sidecar heartbeat that lies)."""
    stop_beating = tmp_path / "stop"
    with ScratchDaemon(tmp_path, config=FAST) as d:
        own, aside = (d.run([sys.executable, "-c", POLL, str(stop_beating), how], "--stack-timeout", "2",
                            "--heartbeat-timeout", "3600") for how in ("from its loop", "from a side thread"))
        try:
            (inc,) = wait_for(d.settled, 30, "the incident of the poller whose beats come from a side thread")
            def let_be() -> list[dict]:
                return [e for e in d.logs() if e.get("event") == "stack_frozen_working" and "beat" in str(e.get("why"))]
            wait_for(let_be, 20, "the loop that beats let be")
            d.looked(2, after=time.time() + 4)  # the one that beats from its loop held still for twice its timeout
            assert len(d.store().list()) == 1
            beating = let_be()
            assert len(beating) >= 2 and all(e["pid"] not in inc["processes"] for e in beating)
            stop_beating.touch()  # it polls on, without a beat: its still stack is judged again
            incs = wait_for(lambda: d.settled() if len(d.settled()) == 2 else None, 30,
                            "the incident of the loop that stopped beating")
            (later,) = [i for i in incs if i["id"] != inc["id"]]
            assert later["reason"] == "stack" and {e["pid"] for e in beating} == set(later["processes"])
        finally:
            for p in (own, aside):
                stop(p, sig=signal.SIGKILL)


def test_a_learned_timeout_catches_a_fast_loop_within_seconds(tmp_path: Path) -> None:
    code = ("import time, hangwatchd\n"
            "for _ in range(80): hangwatchd.beat(); time.sleep(0.05)\n"
            "print('hanging', time.time(), flush=True)\n"
            "import threading; threading.Event().wait()\n")
    with ScratchDaemon(tmp_path, config={**FAST, "heartbeat_timeout": 120.0}) as d:
        work = d.run([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            assert work.stdout is not None
            hung_at = float(work.stdout.readline().split()[1])
            (inc,) = wait_for(d.settled, 30, "an incident")
            data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
            assert data["reason"] == "heartbeat" and "learned" in data["detail"]
            assert data["signals"] == ["heartbeat", "stack"]  # a learned timeout waits for the stack to agree
            assert data["time"] - hung_at < 15  # a timeout of seconds, not the configured 120 s
            st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
            (p,) = st["processes"]
            assert p["timeout_source"] == "learned" and p["timeout"] == 5.0
        finally:
            stop(work, sig=signal.SIGKILL)


def test_a_phase_without_beats_whose_stack_moves_is_not_a_hang(tmp_path: Path) -> None:
    """Beats every 50 ms until the daemon has learned them, then 9 s of computing without a beat:
    a new phase, let be, and its longer gap learned."""
    go = tmp_path / "go"
    code = ("import os, sys, time, hangwatchd\n"
            "while not os.path.exists(sys.argv[1]): hangwatchd.beat(); time.sleep(0.05)\n"
            "def checkpoint(t):\n    end = time.time() + t\n    n = 0\n    while time.time() < end:\n        n += 1 + sum(range(n % 5000))\n"
            "checkpoint(9)\n"
            "while True: hangwatchd.beat(); time.sleep(0.05)\n")
    with ScratchDaemon(tmp_path, config={**FAST, "heartbeat_timeout": 120.0}) as d:
        work = d.run([sys.executable, "-c", code, str(go)])
        try:
            def learned() -> bool:
                st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
                return any(p.get("timeout_source") == "learned" for p in st["processes"])
            wait_for(learned, 60, "the beat to be learned", every=0.5)
            go.touch()
            wait_for(lambda: any(e.get("event") == "suspicion_dropped" and str(e.get("why")).startswith(("the stack moved", "working:")) for e in d.logs()),
                     30, "the checkpoint phase to be let be")
            def pause_learned() -> dict | None:  # its beats came back: the gap they left was learned
                st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
                (p,) = st["processes"]
                return p if p["timeout"] > 5.0 else None
            p = wait_for(pause_learned, 30, "the beats back and the pause learned", every=0.5)
            assert p["state"] == "healthy" and d.store().list() == []  # from its start to its end: no hang
        finally:
            stop(work, sig=signal.SIGKILL)


def test_sd_notify_watchdog_counts_as_a_beat_and_status_is_kept(tmp_path: Path) -> None:
    code = ("import os, socket, time\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); addr = os.environ['NOTIFY_SOCKET']\n"
            "for i in range(3000): s.sendto(os.urandom(64), addr)\n"  # a flood of garbage first
            "s.sendto(b'READY=1', addr)\n"
            "for i in range(30): s.sendto(f'WATCHDOG=1\\nSTATUS=serving step {i}'.encode(), addr); time.sleep(0.05)\n"
            "print('stopped', flush=True)\n"
            "import threading; threading.Event().wait()\n")
    with ScratchDaemon(tmp_path, config={**FAST, "learn_timeouts": False}) as d:
        work = d.run([sys.executable, "-c", code], "--heartbeat-timeout", "2", stdout=subprocess.PIPE)
        try:
            assert work.stdout is not None and work.stdout.readline() == b"stopped\n"
            def status() -> dict:
                (p,) = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)["processes"]
                return p
            p = wait_for(lambda: (lambda p: p if p["notify_status"] == "serving step 29" else None)(status()), 5, "the status")
            assert p["beats"] >= 30
            (inc,) = wait_for(d.settled, 20, "an incident")
            data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
            assert data["notify_status"] == "serving step 29"
            assert d.proc.poll() is None
        finally:
            stop(work, sig=signal.SIGKILL)
