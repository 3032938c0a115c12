"""A daemon standing for one GPU node, for the tests: its GPUs (NVML's API over files, tests/fake_nvml), its
kernel log (a FIFO the test writes kernel log records into, which the daemon follows as it follows
/dev/kmsg: config kernel_log), and ranks under hangwatchd run that beat until told to stop."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hangwatchd.testing import ScratchDaemon, stop, wait_for
from tests.s3server import S3Server

from .conftest import hangwatchd

FAKE_NVML = Path(__file__).parent / "fake_nvml"
FAST = {"pyspy_native": False, "gpu_dump": "never", "capture_steps": ["proc", "pyspy", "nvml"], "store_poll_interval": 0.5}

# A rank that beats until told to stop (its go file), then hangs; it says its pid first.
RANK = """
import os, sys, threading, time, hangwatchd
print(os.getpid(), flush=True)
while not os.path.exists(sys.argv[1]):
    hangwatchd.beat()
    time.sleep(0.05)
print("stopped", flush=True)
threading.Event().wait()
"""
# The rest of a real XID 31 line, as an H200's driver (580) logged an illegal address (docs/gpu-evidence.md).
MMU_FAULT = ("channel 0x0000001e, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC4 GPCCLIENT_T1_8 faulted @ 0x7ff1_14a00000. "
             "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE")


class Rank:
    def __init__(self, node: Node, job: str, gpu: int, timeout: float, rank: int | None) -> None:
        self.go = node.base / f"go-{job}"
        self.job = job
        self.proc = node.d.run([sys.executable, "-c", RANK, str(self.go)], "--job", job, "--heartbeat-timeout", str(timeout),
                               *(("--rank", str(rank)) if rank is not None else ()), stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.pid = int(self.proc.stdout.readline())
        listed = node.nvml / "processes" / str(gpu)  # NVML's list of the GPU's compute processes
        listed.write_text((listed.read_text() if listed.exists() else "") + f"{self.pid}\n")
        wait_for(lambda: self.pid in node.watched(), 20, f"job {job}'s rank watched")

    def stop_beating(self) -> None:
        self.go.write_text("")
        assert self.proc.stdout is not None and self.proc.stdout.readline() == b"stopped\n"


class Node:
    """A daemon standing for one GPU node: its GPUs (fake NVML), its kernel log (a FIFO), its ranks."""

    def __init__(self, base: Path, name: str | None = None, s3: S3Server | None = None, gpus: int = 2,
                 env: dict[str, str] | None = None, **config: Any) -> None:
        self.base = base
        self.nvml = base / "nvml"
        (self.nvml / "events").mkdir(parents=True)
        (self.nvml / "processes").mkdir()
        (self.nvml / "gpus").write_text(str(gpus))
        if name:
            (self.nvml / "uuid-prefix").write_text(name)
        self.kmsg = base / "kmsg"
        os.mkfifo(self.kmsg)
        env = {"HANGWATCHD_FAKE_NVML": str(self.nvml),
               "PYTHONPATH": os.pathsep.join(p for p in (str(FAKE_NVML), os.environ.get("PYTHONPATH", "")) if p),
               **(s3.env if s3 else {}), **(env or {})}
        extra = ("--store", s3.url(), "--node-name", name) if s3 and name else ()
        self._start = lambda: ScratchDaemon(base / "hw", *extra, env=env, config={**FAST, "kernel_log": str(self.kmsg), **config})
        self.d = self._start()
        self.ranks: list[Rank] = []
        self.seq = 0
        self._gpus_found()

    def _gpus_found(self) -> None:
        wait_for(lambda: self.d.metric("hangwatchd_gpu_xid_errors_total", gpu="0", xid="31") == 0.0, 20,
                 "the GPUs found, their XID series at 0")

    def restart(self) -> None:
        """The daemon stopped and started again on the same dirs (its ranks keep running)."""
        self.d.stop()
        self.d = self._start()
        self._gpus_found()

    def rank(self, job: str, gpu: int = 0, timeout: float = 2.0, rank: int | None = 0) -> Rank:
        self.ranks.append(Rank(self, job, gpu, timeout, rank))
        return self.ranks[-1]

    def watched(self) -> set[int]:
        res = hangwatchd("status", "--json", "--runtime-dir", str(self.d.runtime_dir))
        return {p["pid"] for p in json.loads(res.stdout)["processes"]} if res.returncode == 0 else set()

    def kernel_log(self, message: str) -> None:
        """One record into the kernel log, as /dev/kmsg writes it (PRIO,SEQ,USEC,FLAGS;MESSAGE and its dictionary)."""
        self.seq += 1
        record = f"3,{self.seq},{time.monotonic_ns() // 1000},-;{message}\n SUBSYSTEM=pci\n".encode()

        def opened() -> int | None:
            try:
                return os.open(self.kmsg, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # the daemon's reader is between two writers: it opens it again at once
                    return None
                raise
        fd = wait_for(opened, 10, "the daemon reading its kernel log")
        try:
            os.write(fd, record)
        finally:
            os.close(fd)

    def nvml_event(self, gpu: int, xid: int) -> None:
        tmp = self.nvml / f".{time.monotonic_ns()}.tmp"
        tmp.write_text(json.dumps({"gpu": gpu, "xid": xid}))
        tmp.replace(self.nvml / "events" / f"{time.monotonic_ns()}.json")

    def xids(self, xid: int, gpu: int = 0) -> float | None:
        return self.d.metric("hangwatchd_gpu_xid_errors_total", gpu=str(gpu), xid=str(xid))

    def incident(self, job: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The job's stored incident: its index row and its incident.json."""
        (row,) = wait_for(lambda: [i for i in self.d.store().list() if i["job"] == job], 30, f"job {job}'s incident")
        return row, json.loads((Path(row["dir"]) / "incident.json").read_text())

    def health(self) -> tuple[int, str]:
        res = hangwatchd("health", "--runtime-dir", str(self.d.runtime_dir))
        (line,) = res.stdout.splitlines()  # Node Problem Detector's contract: one line
        return res.returncode, line

    def stop(self) -> None:
        for r in self.ranks:
            stop(r.proc)
        self.d.stop()
