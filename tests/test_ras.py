"""NCCL's RAS view: the real answers of a 2x H200 job, asked over the real protocol, read and blamed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatchd.analyze import ras
from hangwatchd.analyze.verdict import analyze
from hangwatchd.capture.nccl_ras import NcclRasStep
from hangwatchd.capture.pipeline import run_steps
from hangwatchd.host import procfs
from hangwatchd.host.deadline import Deadline
from hangwatchd.model import Registration
from hangwatchd.testing import stop
from hangwatchd.workload import registration_file

from .conftest import extract, hangwatchd

RAS = Path(__file__).parent / "fixtures" / "nccl-ras"


class RasServer(threading.Thread):
    """A RAS service as NCCL runs it: the client handshake, TIMEOUT, SET FORMAT, then one report and close."""

    def __init__(self, text: bytes, js: bytes | None, silent: bool = False) -> None:
        super().__init__(daemon=True)
        self.text, self.js, self.silent = text, js, silent
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.held: list[socket.socket] = []

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            if self.silent:
                self.held.append(conn)  # accepts, reads nothing, answers nothing
                continue
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        fmt = "text"
        with conn, conn.makefile("rb") as lines:
            for raw in lines:
                line = raw.decode().strip()
                if line.startswith("CLIENT PROTOCOL"):
                    conn.sendall(b"SERVER PROTOCOL 2\n")
                elif line.startswith("TIMEOUT") or line.startswith("SET FORMAT"):
                    if line == "SET FORMAT json" and self.js is None:
                        conn.sendall(b"ERROR unknown command\n")  # an NCCL that speaks text only
                        continue
                    fmt = line.split()[-1] if line.startswith("SET FORMAT") else fmt
                    conn.sendall(b"OK\n")
                elif line.endswith("STATUS"):
                    conn.sendall(self.js if fmt == "json" and self.js else self.text)
                    return

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def workload() -> Iterator[Callable[[str | None], Registration]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(ras_addr: str | None) -> Registration:
        env = {"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "2"}
        if ras_addr:
            env["NCCL_RAS_ADDR"] = ras_addr
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
        procs.append(p)
        for _ in range(100):
            if procfs.environ(p.pid).get("RANK") == "0":
                break
            time.sleep(0.02)
        reg = registration_file.from_proc(p.pid)
        assert reg is not None
        return reg

    yield start
    stop(*procs, sig=signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_step_asks_a_real_ras_speaking_server_and_keeps_both_answers(tmp_path: Path, workload) -> None:
    server = RasServer((RAS / "diverged.txt").read_bytes(), (RAS / "diverged.json").read_bytes())
    server.start()
    try:
        reg = workload(server.addr)
        out = tmp_path / "incident" / str(reg.process.pid)
        out.mkdir(parents=True)
        files = NcclRasStep().run(reg, out, Deadline.after(3.0))
    finally:
        server.close()
    assert files == ("nccl-ras.txt", "nccl-ras.json")
    assert (out / "nccl-ras.txt").read_bytes() == (RAS / "diverged.txt").read_bytes()
    assert (out / "nccl-ras.json").read_bytes() == (RAS / "diverged.json").read_bytes()
    view, problems = ras.read(out)
    assert problems == () and view is not None
    (m,) = view.mismatches
    assert (m.collective, [(c.rank, c.count) for c in m.behind], m.ahead) == ("AllReduce", [(1, 10)], 11)


CHURN = """
import os, socket, sys
spare = os.open(os.devnull, os.O_RDONLY)  # a low fd, freed below: the churn takes it again and again
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(1)
os.close(spare)
print(os.fstat(s.fileno()).st_ino, flush=True)
while True:  # a busy process: fds opened and closed all the time, as NCCL's and PyTorch's threads do
    os.close(os.open(os.devnull, os.O_RDONLY))
"""


def test_the_holder_of_a_socket_is_found_in_a_process_that_opens_and_closes_files_all_the_time() -> None:
    """The RAS step believes an answer only from a process of the job that holds the listening
    socket. An fd closed between listing a process's fds and reading one made the whole process
    look like it held nothing (seen in CI: the JSON answer refused as another's)."""
    from hangwatchd.capture.nccl_ras import holder_of

    p = subprocess.Popen([sys.executable, "-c", CHURN], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        inode = int(p.stdout.readline())
        # No time left for the scan of every process: the likely holder must be recognised at first look.
        found = [holder_of(inode, os.getuid(), [p.pid], time.monotonic()) for _ in range(500)]
        assert found.count(p.pid) == len(found), f"found {found.count(p.pid)} times of {len(found)}"
    finally:
        stop(p, sig=signal.SIGKILL)


def test_ranks_sharing_a_ras_address_ask_it_once_per_incident(tmp_path: Path, workload) -> None:
    server = RasServer((RAS / "dead-70s.txt").read_bytes(), None)  # text only, like NCCL before 2.27
    server.start()
    try:
        step = NcclRasStep()
        regs = [workload(server.addr), workload(server.addr)]
        for reg in regs:
            (tmp_path / "inc" / str(reg.process.pid)).mkdir(parents=True)
        threads = [threading.Thread(target=step.run, args=(r, tmp_path / "inc" / str(r.process.pid), Deadline.after(3.0)))
                   for r in regs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # text, then one try at JSON which this NCCL refuses: two connections for both ranks
        assert server.connections == 2
        for reg in regs:
            assert (tmp_path / "inc" / str(reg.process.pid) / "nccl-ras.txt").read_bytes() == (RAS / "dead-70s.txt").read_bytes()
            assert not (tmp_path / "inc" / str(reg.process.pid) / "nccl-ras.json").exists()
        (tmp_path / "inc2" / "1").mkdir(parents=True)
        step.run(regs[0], tmp_path / "inc2" / "1", Deadline.after(3.0))  # the next incident asks again
        assert server.connections == 4
    finally:
        server.close()


@pytest.mark.parametrize("listening", [False, True], ids=["closed-port", "silent-listener"])
def test_an_unreachable_ras_port_is_one_na_line_within_its_deadline(tmp_path: Path, workload, listening: bool) -> None:
    server = RasServer(b"", None, silent=True) if listening else None
    if server:
        server.start()
    addr = server.addr if server else f"127.0.0.1:{free_port()}"
    try:
        reg = workload(addr)
        start = time.monotonic()
        cap = run_steps([(NcclRasStep(), 1.0)], reg, tmp_path / "x" / str(reg.process.pid), Deadline.after(30.0))
        took = time.monotonic() - start
    finally:
        if server:
            server.close()
    (res,) = cap.steps
    assert took < 1.5, took  # the deadline, not a socket default
    assert res.ok and res.not_applicable and res.error is not None  # n/a, not a failure
    assert "\n" not in res.error and addr in res.error
    assert list((tmp_path / "x" / str(reg.process.pid)).iterdir()) == []


def test_the_address_is_the_processs_own_then_the_registered_then_the_default() -> None:
    from hangwatchd.capture.nccl_ras import address_of, split_address

    assert address_of({}, None) == "localhost:28028"
    assert address_of({}, "127.0.0.1:41000") == "127.0.0.1:41000"
    assert address_of({"NCCL_RAS_ADDR": "[::1]:41001"}, "127.0.0.1:41000") == "[::1]:41001"  # what NCCL reads wins
    assert split_address("[::1]:41001") == ("::1", 41001) and split_address(":41002") == ("localhost", 41002)
    with pytest.raises(ValueError):
        split_address("localhost")



def test_a_remote_ras_address_is_refused_without_a_connection(tmp_path: Path, workload) -> None:
    reg = workload("192.0.2.1:28028")  # TEST-NET: root never connects where a user's environment points
    start = time.monotonic()
    cap = run_steps([(NcclRasStep(), 2.0)], reg, tmp_path / "x" / str(reg.process.pid), Deadline.after(30.0))
    (res,) = cap.steps
    assert time.monotonic() - start < 0.5 and res.not_applicable and res.error is not None
    assert res.error.startswith("NCCL_RAS_ADDR") and "not an address of this node" in res.error


def place(incident: Path, pid: int, rank: int, *ras_files: str, host: str = "192.0.2.2") -> Path:
    pdir = incident / str(pid)
    pdir.mkdir(parents=True)
    (pdir / "proc.json").write_text(json.dumps({"pid": pid, "rank": rank, "world_size": 2, "hostname": host}))
    native = [{"thread_name": "MainThread", "frames": [
        {"name": "ncclGroupEnd", "short_filename": "libnccl.so.2", "module": "/usr/lib/libnccl.so.2", "line": 0},
        {"name": "train_step", "filename": "/srv/job/train.py", "short_filename": "train.py", "line": 40}]}]
    (pdir / "pyspy-native.json").write_text(json.dumps(native))
    for f in ras_files:
        shutil.copy(RAS / f, pdir / ("nccl-ras" + Path(f).suffix))
    return pdir


@pytest.mark.parametrize("files,state", [(("dead-5s.json",), "missing"), (("dead-70s.txt",), "dead"),
                                         (("dead-70s.json", "dead-70s.txt"), "dead")])
def test_a_peer_that_ras_calls_missing_is_the_culprit(tmp_path: Path, files: tuple[str, ...], state: str) -> None:
    place(tmp_path, 786, 0, *files)
    res = hangwatchd("analyze", str(tmp_path), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    (culprit,) = out["culprits"]  # the rank that waits for it is no culprit
    assert (culprit["rank"], culprit["pid"], culprit["node"], culprit["gpu"]) == (1, 787, "192.0.2.2", 1)
    assert state in culprit["reason"] and "NCCL RAS" in culprit["reason"]
    assert out["summary"].startswith(f"Rank 1 (pid 787 on node 192.0.2.2, GPU 1) is {state}")
    assert "rank 0 waits in ncclGroupEnd" in out["summary"]
    text = hangwatchd("analyze", str(tmp_path)).stdout
    assert "Culprit: rank 1 (pid 787 on node 192.0.2.2, GPU 1)" in text


@pytest.mark.parametrize("name", ["diverged.txt", "diverged.json"])
def test_a_ras_mismatch_names_the_rank_that_is_behind(tmp_path: Path, name: str) -> None:
    place(tmp_path, 786, 0, name)
    out = analyze(tmp_path).to_dict()
    (culprit,) = out["culprits"]
    assert (culprit["rank"], culprit["pid"], culprit["node"]) == (1, 787, "192.0.2.2")
    assert "launched 10 AllReduce" in culprit["reason"] and "11" in culprit["reason"]
    assert out["summary"].startswith("Rank 1 (pid 787 on node 192.0.2.2, GPU 1) is behind: it launched 10 AllReduce")


def test_nccl_2_28_9s_invalid_json_and_the_text_say_the_same(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        json.loads((RAS / "dead-70s.json").read_text())  # the fault NCCL ships
    from_json, _ = ras.parse_json((RAS / "dead-70s.json").read_text())
    from_text, _ = ras.parse_text((RAS / "dead-70s.txt").read_text())
    assert from_json is not None and from_text is not None
    assert from_json.missing == from_text.missing
    assert from_json.version == from_text.version == "2.28.9"


def test_another_jobs_ras_answer_is_not_used(tmp_path: Path) -> None:
    place(tmp_path, 4242, 0, "dead-70s.json")  # the default port held by another job: pid 4242 is not in it
    out = analyze(tmp_path).to_dict()
    assert out["culprits"][0]["rank"] == 0 and "787" not in out["summary"]
    assert any("another job's service, not used" in u for u in out["unreadable"])


def test_a_ras_file_that_is_not_one_is_a_line_in_the_report(tmp_path: Path) -> None:
    pdir = place(tmp_path, 786, 0)
    (pdir / "nccl-ras.json").write_bytes(b"\xff{not json")
    (pdir / "nccl-ras.txt").write_text("Connection refused\n")
    out = analyze(tmp_path).to_dict()
    assert any("nccl-ras.json" in u for u in out["unreadable"]) and any("nccl-ras.txt" in u for u in out["unreadable"])


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=2000), st.sampled_from(sorted(p.name for p in RAS.glob("*.*") if p.suffix != ".md")))
def test_the_ras_reader_never_raises(noise: str, base: str) -> None:
    whole = (RAS / base).read_text()
    for text in (noise, whole[: len(noise)] + noise, noise + whole, whole.replace('"', noise[:3] or "'")):
        for parse in (ras.parse_json, ras.parse_text):
            start = time.monotonic()
            view, why = parse(text)
            assert (view is None) == bool(why)
            assert time.monotonic() - start < 1.0


RUN_CODE = """
import glob, json, os, sys, time, threading, hangwatchd
for _ in range(5): hangwatchd.beat(); time.sleep(0.05)
keys = ("NCCL_RAS_ADDR", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
reg = None
for _ in range(200):  # the launcher registers us just after we start
    for f in glob.glob(os.path.join(os.environ["HANGWATCHD_RUNTIME_DIR"], "registrations", "*")):
        data = json.load(open(f))
        if data.get("pid") == os.getpid():
            reg = data
    if reg: break
    time.sleep(0.02)
print(json.dumps({**{k: os.environ.get(k) for k in keys}, "registered": (reg or {}).get("ras_addr"), "pid": os.getpid()}), flush=True)
def all_reduce_wait():
    threading.Event().wait()
all_reduce_wait()
"""


def test_run_gives_each_workload_its_own_ras_address_and_the_flight_recorder_names(tmp_path: Path) -> None:
    from hangwatchd.testing import ScratchDaemon

    with ScratchDaemon(tmp_path / "d", config={"gpu_dump": "never", "capture_steps": ["proc"]}) as d:
        mine = "127.0.0.1:45999"
        procs = [d.run([sys.executable, "-c", RUN_CODE], stdout=subprocess.PIPE, env=env)
                 for env in (dict(os.environ), dict(os.environ), dict(os.environ, NCCL_RAS_ADDR=mine, TORCH_NCCL_TRACE_BUFFER_SIZE="77"))]
        try:
            seen = [json.loads(p.stdout.readline()) for p in procs if p.stdout is not None]
        finally:
            stop(*procs, sig=signal.SIGKILL)
    a, b, user = seen
    assert a["NCCL_RAS_ADDR"] != b["NCCL_RAS_ADDR"] and a["NCCL_RAS_ADDR"].startswith("127.0.0.1:")
    assert a["registered"] == a["NCCL_RAS_ADDR"] and b["registered"] == b["NCCL_RAS_ADDR"]
    assert user["NCCL_RAS_ADDR"] == user["registered"] == mine  # what the user set wins
    assert a["TORCH_FR_BUFFER_SIZE"] == a["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"  # PyTorch 2.11 and older alike
    assert a["TORCH_FR_DUMP_TEMP_FILE"] == a["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert user["TORCH_FR_BUFFER_SIZE"] == user["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "77"  # the user's old name, under both


def test_the_daemon_asks_the_jobs_ras_and_blames_the_dead_peer(tmp_path: Path) -> None:
    from hangwatchd.testing import ScratchDaemon, wait_for

    server = RasServer((RAS / "dead-70s.txt").read_bytes(), (RAS / "dead-70s.json").read_bytes())
    server.start()
    try:
        config = {"gpu_dump": "never", "pyspy_native": False, "capture_steps": ["proc", "pyspy", "nccl_ras"]}
        with ScratchDaemon(tmp_path / "d", config=config) as d:
            env = dict(os.environ, NCCL_RAS_ADDR=server.addr, RANK="0", WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
            p = d.run([sys.executable, "-c", RUN_CODE], "--heartbeat-timeout", "1", stdout=subprocess.PIPE, env=env)
            try:
                # the answer is the real job's, with its surviving rank's pid made our workload's
                assert p.stdout is not None
                pid = json.loads(p.stdout.readline())["pid"]
                assert server.text is not None
                server.text = server.text.replace(b"786", str(pid).encode())
                assert server.js is not None
                server.js = server.js.replace(b"786", str(pid).encode())
                (inc,) = wait_for(d.settled, 30, "an incident")
            finally:
                stop(p, sig=signal.SIGKILL)
    finally:
        server.close()
    incident = Path(inc["dir"])
    (pdir,) = [x for x in incident.iterdir() if x.is_dir()]
    assert (pdir / "nccl-ras.txt").read_bytes() == (RAS / "dead-70s.txt").read_bytes()
    meta = json.loads((incident / "incident.json").read_text())
    (step,) = [s for s in meta["processes"][0]["steps"] if s["step"] == "nccl_ras"]
    assert step["ok"] and step["seconds"] < 1.0
    culprit = meta["analysis"]["culprits"][0]
    assert (culprit["rank"], culprit["pid"], culprit["node"]) == (1, 787, "192.0.2.2")
    assert inc["summary"].startswith("Rank 1 (pid 787 on node 192.0.2.2, GPU 1) is dead")


def test_the_flight_recorder_keeps_its_lead_where_ras_names_the_same_rank(tmp_path: Path) -> None:
    extract(Path(__file__).parent / "fixtures" / "h200-diverged" / "incident.tar.xz", tmp_path)
    incident = tmp_path / "diverged-incident"
    rank0 = next(p for p in incident.iterdir() if (p / "proc.json").exists() and json.loads((p / "proc.json").read_text())["rank"] == 0)
    shutil.copy(RAS / "diverged.txt", rank0 / "nccl-ras.txt")  # NCCL too says rank 1 is behind
    out = analyze(incident).to_dict()
    assert out["summary"].startswith("Rank 1 never entered all_gather #21 (process group 0)")
    (culprit,) = out["culprits"]
    assert culprit["rank"] == 1 and culprit["location"].startswith("evaluate_only_on_rank_1") and culprit["node"] == "192.0.2.2"


NCCL_2_24_KILLED = """NCCL version 2.24.3 compiled with CUDA 12.6

Communicators... (2.05s)
=============

Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors
    #  in group  per comm  per node  per comm  in group
    0         1         4       7-8        32        31   RUNNING  INCOMPLETE

Errors
======

{heading}
  {what}
  Process 3487984 on node 172.16.64.213 managing GPU 5

#0-0 (cf264af53edbe986) INCOMPLETE
  Missing communicator data from 1 rank
  The missing rank: 21

Warnings
========

TIMEOUT
  Encountered 2 communication timeouts while gathering communicator data
"""


@pytest.mark.parametrize("heading,what,state", [
    ("INCOMPLETE", "Missing communicator data from 1 job process", "missing"),
    ("DEAD", "1 job process is considered dead (unreachable via the RAS network)", "dead")])
def test_the_older_form_naming_the_missing_rank_by_number_is_joined_to_its_process(heading: str, what: str, state: str) -> None:
    view, why = ras.parse_text(NCCL_2_24_KILLED.format(heading=heading, what=what))
    assert view is not None, why
    (r,) = view.missing
    assert (r.rank, r.pid, r.node, r.gpu, r.state) == (21, 3487984, "172.16.64.213", 5, state)
