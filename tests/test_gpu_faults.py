"""Every XID given to whoever caused it, and a memory of the GPUs and nodes that keep failing jobs.

Real daemons with NVML's API over files (tests/fake_nvml) and a kernel log that is a FIFO the test writes
kernel log records into, read by the very reader the daemon follows /dev/kmsg with (config kernel_log);
real workloads under hangwatchd run; the ledger read back locally and from a real S3 server standing for
the fleet's store, with daemons standing for nodes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hangwatchd.testing import wait_for
from tests.s3server import S3Server

from .conftest import hangwatchd
from .gpu_node import MMU_FAULT, Node


def gpu_events_of(row: dict[str, Any], pid: int) -> dict[str, Any]:
    return json.loads((Path(row["dir"]) / str(pid) / "gpu-events.json").read_text())


def test_an_application_xid_is_its_own_process_fault_and_context_for_others_and_only_a_gpu_xid_explains_any_hang(
        tmp_path: Path) -> None:
    n = Node(tmp_path)
    try:
        # Two jobs on GPU 0. The eval job's process hits an illegal address: the kernel log names it, NVML
        # reports the same XID; one XID, counted once.
        evaluation = n.rank("eval", timeout=600, rank=None)
        train = n.rank("train")
        n.kernel_log(f"NVRM: Xid (PCI:0000:18:00): 31, pid={evaluation.pid}, name=python3, {MMU_FAULT}")
        n.nvml_event(gpu=0, xid=31)
        wait_for(lambda: n.xids(31) == 1.0, 20, "XID 31 counted")
        assert n.health()[0] == 0  # an application's fault is never the node's
        # Then the train job hangs, a second later, beside it on the same GPU.
        train.stop_beating()
        row, record = n.incident("train")
        summary = row["summary"]
        assert not summary.startswith("GPU 0 reported") and "a GPU fault" not in summary, summary
        assert (f"another process on GPU 0, pid {evaluation.pid} (python3) of job eval, hit XID 31 (GPU memory page "
                "fault)") in summary.lower() or (f"Another process on GPU 0, pid {evaluation.pid} (python3) of job eval, "
                                                 "hit XID 31 (GPU memory page fault)") in summary, summary
        assert "not this hang's cause" in summary
        (event,) = gpu_events_of(row, train.pid)["events"]
        assert (event["pid"], event["own"], event["job"], event["kind"], event["source"], event["xid"]) == \
            (evaluation.pid, False, "eval", "application", "nvml+kmsg", 31)
        assert n.xids(31) == 1.0  # the kernel log's line and NVML's event were one XID
        assert record["analysis"]["blame"] == []  # nothing against the GPU
        assert not list((n.d.state_dir / "ledger").glob("*.json"))

        # A process's own illegal address: blamed on the program, recorded against the GPU it ran on.
        own = n.rank("own")
        n.kernel_log(f"NVRM: Xid (PCI:0000:18:00): 31, pid={own.pid}, name=pt_main_thread, {MMU_FAULT}")
        wait_for(lambda: n.xids(31) == 2.0, 20, "the second XID 31 counted")
        own.stop_beating()
        row, record = n.incident("own")
        assert row["summary"].startswith("Rank 0 hit XID 31 (GPU memory page fault) on GPU 0 ") and \
            "a fault of the program itself" in row["summary"], row["summary"]
        (blame,) = record["analysis"]["blame"]
        assert (blame["kind"], blame["gpu"], blame["uuid"], blame["serial"], blame["pci"], blame["pid"], blame["xid"]) == \
            ("application", 0, "GPU-fake-0", "1650000000", "0000:18:00", own.pid, 31)
        assert n.health()[0] == 0  # one job's own fault: the job's, not the node's
        assert n.d.metric("hangwatchd_gpu_implicating_jobs", gpu="0", UUID="GPU-fake-0") == 1.0

        # The GPU falls off the bus (the driver names no process): it explains the next hang on it.
        after = n.rank("after")
        n.kernel_log("NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
        wait_for(lambda: n.xids(79) == 1.0, 20, "XID 79 counted")
        after.stop_beating()
        row, record = n.incident("after")
        assert row["summary"].startswith("GPU 0 reported XID 79 (fell off the bus) ") and \
            "a GPU fault, not the program, likely explains the hang" in row["summary"], row["summary"]
        (blame,) = record["analysis"]["blame"]
        assert (blame["kind"], blame["uuid"], blame["xid"]) == ("gpu", "GPU-fake-0", 79)
        code, line = n.health()
        assert code == 1 and "GPU 0 reported XID 79 (fell off the bus)" in line and "reset" in line, line
        # Two different jobs' incidents implicate GPU 0 within the day: the ledger makes it a suspect.
        wait_for(lambda: n.d.metric("hangwatchd_gpu_suspect", gpu="0", UUID="GPU-fake-0") == 1.0, 10, "GPU 0 a suspect")
        assert n.d.metric("hangwatchd_gpu_implicating_jobs", gpu="0", UUID="GPU-fake-0") == 2.0
        assert n.d.metric("hangwatchd_gpu_suspect", gpu="1", UUID="GPU-fake-1") == 0.0
        shown = hangwatchd("show", row["id"], "--state-dir", str(n.d.state_dir)).stdout
        assert "Blames the GPU: GPU 0 (GPU-fake-0, serial 1650000000)" in shown, shown
        # A restarted daemon forgets the XID it heard, not the ledger: GPU 0 is still a suspect.
        n.restart()
        code, line = n.health()
        assert code == 1 and "GPU 0 (GPU-fake-0, serial 1650000000) was implicated by 2 different jobs in 24 h " \
            "(own, after; XID 31, XID 79): suspect the GPU" in line, line
        assert n.d.metric("hangwatchd_gpu_suspect", gpu="0", UUID="GPU-fake-0") == 1.0
    finally:
        n.stop()
    res = hangwatchd("suspects", "--state-dir", str(n.d.state_dir), "--json")
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    (gpu,) = found["gpus"]
    assert (gpu["gpu"], gpu["serial"], gpu["index"], gpu["kinds"], gpu["xids"], gpu["job_names"], gpu["score"]) == \
        ("GPU-fake-0", "1650000000", 0, ["application", "gpu"], [31, 79], ["own", "after"], 2)
    text = hangwatchd("suspects", "--state-dir", str(n.d.state_dir)).stdout
    assert "GPU-fake-0 (GPU 0)" in text and "own, after" in text, text


def test_suspects_across_nodes_from_the_shared_store(tmp_path: Path, s3: S3Server) -> None:
    a = Node(tmp_path / "a", "node-a", s3)
    b = Node(tmp_path / "b", "node-b", s3)
    try:
        # On node-a two different jobs each hit their own illegal address on GPU 1, one job on node-b
        # hangs after its GPU 0 reported a double-bit ECC error.
        alpha, beta = a.rank("alpha", gpu=1), a.rank("beta", gpu=1)
        gamma = b.rank("gamma", gpu=0)
        for r in (alpha, beta):
            a.kernel_log(f"NVRM: Xid (PCI:0000:19:00): 31, pid={r.pid}, name=python3, {MMU_FAULT}")
        b.kernel_log(f"NVRM: Xid (PCI:0000:18:00): 48, pid={gamma.pid}, name=python3, An uncorrectable double bit error")
        wait_for(lambda: a.xids(31, gpu=1) == 2.0 and b.xids(48) == 1.0, 20, "the XIDs counted")
        for r in (alpha, beta, gamma):
            r.stop_beating()
        for node, job in ((a, "alpha"), (a, "beta"), (b, "gamma")):
            node.incident(job)
        # Node-a's GPU 1 failed two different jobs within the day: a node problem, though each fault was
        # the application's own; node-b's GPU needs a reset.
        wait_for(lambda: a.health()[0] == 1, 10, "node-a's health")
        code, line = a.health()
        assert "GPU 1 (GPU-node-a-1, serial 1650000001) was implicated by 2 different jobs in 24 h" in line, line
        assert a.d.metric("hangwatchd_gpu_suspect", gpu="1", UUID="GPU-node-a-1") == 1.0
        assert "GPU 0 reported XID 48 (double-bit ECC error)" in b.health()[1]
        assert b.d.metric("hangwatchd_gpu_suspect", gpu="0", UUID="GPU-node-b-0") == 0.0  # one job: not yet
        wait_for(lambda: len(s3.keys("hw/ledger/")) == 3, 30, "the three ledger entries in the store", every=0.5)
    finally:
        a.stop()
        b.stop()
    # A GPU is its UUID wherever it goes: node-c (once it held node-a's GPU 1, before a repair) files
    # another user's job against it; and something that is no ledger entry sits in the store.
    entry = {"v": 1, "incident": "20260101T000000Z-c0ffee", "time": time.time() - 3600, "node": "node-c",
             "job": "delta", "job_key": "1001:job delta", "uid": 1001, "user": "bob", "verdict": "...",
             "blames": [{"kind": "gpu", "why": "GPU 5 reported XID 95 (uncontained ECC error)", "node": "node-c", "gpu": 5,
                         "uuid": "GPU-node-a-1", "serial": "1650000001", "xid": 95, "pid": 7, "rank": 0, "time": 1.0}]}
    c = s3.client()
    c.put_object(Bucket=s3.bucket, Key="hw/ledger/node-c/20260101T000000Z-c0ffee.json", Body=json.dumps(entry).encode())
    c.put_object(Bucket=s3.bucket, Key="hw/ledger/node-c/20260101T000001Z-bad.json",
                 Body=b'{"v": 1, "incident": "x", "blames": "everything"}')
    c.put_object(Bucket=s3.bucket, Key="hw/ledger/node-d/20260101T000002Z-liar.json",  # filed under another node's name
                 Body=json.dumps({**entry, "incident": "liar"}).encode())
    c.put_object(Bucket=s3.bucket, Key="hw/ledger/node-c/..json", Body=json.dumps(entry).encode())
    res = hangwatchd("suspects", "--store", s3.url(), "--json", env=s3.env)
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    gpus = {g["gpu"]: g for g in found["gpus"]}
    assert set(gpus) == {"GPU-node-a-1", "GPU-node-b-0"}
    top = found["gpus"][0]
    # Three jobs of two users: 3 + 2 - 1; where it is now: node-a, its newest.
    assert (top["gpu"], top["node"], sorted(top["job_names"]), top["users"][0], top["score"], len(top["incidents"])) == \
        ("GPU-node-a-1", "node-a", ["alpha", "beta", "delta"], "bob", 4, 3), top
    assert (gpus["GPU-node-b-0"]["score"], gpus["GPU-node-b-0"]["kinds"], gpus["GPU-node-b-0"]["xids"]) == (1, ["gpu"], [48])
    assert [(n["node"], n["score"]) for n in found["nodes"]] == [("node-a", 2), ("node-c", 1), ("node-b", 1)] or \
        [(n["node"], n["score"]) for n in found["nodes"]] == [("node-a", 2), ("node-b", 1), ("node-c", 1)]
    text = hangwatchd("suspects", "--store", s3.url(), env=s3.env)
    assert text.returncode == 0 and "GPU-node-a-1" in text.stdout and "delta, alpha, beta" in text.stdout, text.stdout
    assert "refused" in text.stderr  # what was left out is said, on stderr
    # This node's own ledger, read locally, knows only its own incidents.
    local = json.loads(hangwatchd("suspects", "--state-dir", str(a.d.state_dir), "--json").stdout)
    assert [(g["gpu"], g["score"]) for g in local["gpus"]] == [("GPU-node-a-1", 2)]


def test_bad_input_to_suspects_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, says in ((["--store", "http://not-s3"], "is not an s3:// URL"), (["--since", "yesterday-ish"], "expected a time"),
                       (["--state-dir", str(tmp_path / "nowhere")], "does not exist")):
        res = hangwatchd("suspects", *args)
        assert res.returncode == 2 and says in res.stderr and len(res.stderr.splitlines()) == 1, (args, res.stderr)
    empty = tmp_path / "state"
    empty.mkdir()
    res = hangwatchd("suspects", "--state-dir", str(empty))
    assert res.returncode == 0 and "no incident" in res.stdout and "blames a GPU" in res.stdout


def hand_made(base: Path, events: list[dict[str, Any]]) -> Path:
    """An incident put together by hand: rank 3 (pid 4174) on GPU 3, stopped at a known time, with these events."""
    inc = base / "by-hand"
    pdir = inc / "4174"
    pdir.mkdir(parents=True)
    stopped = 1_764_000_000.0
    (inc / "incident.json").write_text(json.dumps({"id": "x", "reason": "heartbeat", "since": stopped, "node": "gpu-node-7",
                                                    "processes": [{"pid": 4174, "rank": 3}]}))
    (pdir / "proc.json").write_text(json.dumps({"pid": 4174, "rank": 3, "job": "train", "state": "S (sleeping)"}))
    (pdir / "pyspy.json").write_text(json.dumps([{"thread_name": "MainThread", "frames": [
        {"name": "synchronize", "filename": "/usr/lib/python3/site-packages/torch/cuda/__init__.py", "line": 800},
        {"name": "train_step", "filename": "/home/u/train.py", "line": 42}]}]))
    (pdir / "gpu-events.json").write_text(json.dumps({"pid": 4174, "gpus": [3], "stopped": stopped, "events": [
        {"time": stopped + e.pop("dt"), "gpu": 3, **e} for e in events]}))
    return inc


def test_an_xid_whose_process_nobody_named_is_never_taken_for_the_cause_and_one_a_gpu_fault_caused_is_the_gpus(
        tmp_path: Path) -> None:
    # NVML alone (the kernel log not read): an application's XID 31 is said, never the cause.
    inc = hand_made(tmp_path / "nvml-only", [{"dt": -1.0, "xid": 31}])
    analysis = json.loads(hangwatchd("analyze", str(inc), "--json").stdout)
    assert not analysis["summary"].startswith("GPU 3") and "a GPU fault" not in analysis["summary"], analysis["summary"]
    assert "GPU 3 reported XID 31 (GPU memory page fault) 1 s before rank 3 stopped, an application's fault whose " \
           "process the kernel log would name (not read here): not taken for this hang's cause" in analysis["summary"]
    assert analysis["blame"] == []
    # A channel the driver ended because the GPU failed (45 caused by 149, an NVLink error) is the GPU's fault.
    inc = hand_made(tmp_path / "sympathetic", [{"dt": -2.0, "xid": 45, "cause": 149, "pid": 999, "uuid": "GPU-3", "serial": "7"}])
    analysis = json.loads(hangwatchd("analyze", str(inc), "--json").stdout)
    assert analysis["summary"].startswith("GPU 3 reported XID 45 (channel ended early (preemptive cleanup)) 2 s before "
                                          "rank 3 stopped: a GPU fault, not the program"), analysis["summary"]
    (blame,) = analysis["blame"]
    assert (blame["kind"], blame["uuid"], blame["serial"], blame["node"], blame["rank"]) == ("gpu", "GPU-3", "7", "gpu-node-7", 3)
    # The process's own fault, named by pid in a directory put together by hand.
    inc = hand_made(tmp_path / "own", [{"dt": 0.0, "xid": 13, "pid": 4174}])
    summary = json.loads(hangwatchd("analyze", str(inc), "--json").stdout)["summary"]
    assert summary.startswith("Rank 3 hit XID 13 (graphics engine exception) on GPU 3 as it stopped: a fault of the "
                              "program itself"), summary
