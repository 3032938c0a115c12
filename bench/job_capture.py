"""Eight ranks of one job on one node, all captured and stored in the shared store:
the time from the hang being declared to the job incident's manifest in the store,
against capturing the same eight ranks one after another, measured in the same run.

The ranks are CPU stand-ins with real FIFOs for PyTorch's flight recorder
(``python -m hangwatchd.testing gpu-workload --cuda none``); the store is moto's S3
server on loopback. Target: within 5 s of the hang being declared.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd import config, log  # noqa: E402 - after the repository is put on sys.path
from hangwatchd.capture import make_steps, run_steps  # noqa: E402 - after sys.path is set
from hangwatchd.host.deadline import Deadline  # noqa: E402 - after sys.path is set
from hangwatchd.testing import ScratchDaemon, stop, wait_for  # noqa: E402 - after sys.path is set
from hangwatchd.workload import registration_file  # noqa: E402 - after sys.path is set
from tests.s3server import S3Server  # noqa: E402 - after sys.path is set

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, report  # noqa: E402 - after sys.path is set

RANKS = 8
TARGET = 5.0
CONFIG = {"pyspy_native": False, "gpu_dump": "never", "flight_recorder_timeout": 10.0, "store_poll_interval": 1.0}


def _ranks(d: ScratchDaemon, job: str, timeout: float) -> list[subprocess.Popen[bytes]]:
    argv = [sys.executable, "-m", "hangwatchd.testing", "gpu-workload", "--cuda", "none", "--fr", "answer", "--beats", "20"]
    return [d.run(argv, "--job", job, "--rank", str(r), "--heartbeat-timeout", str(timeout),
                  env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(RANKS)), stdout=subprocess.DEVNULL) for r in range(RANKS)]


def _workload_pids(d: ScratchDaemon) -> list[int]:
    """The workloads (not their launchers) as the daemon watches them."""
    status = json.loads((d.runtime_dir / "status.json").read_text())
    return [p["pid"] for p in status["processes"]]


def main() -> None:
    log.configure("console", "warning")
    with tempfile.TemporaryDirectory() as t, S3Server() as s3:
        base = Path(t)
        # Together: the daemon's parallel capture and upload.
        with ScratchDaemon(base / "node", "--store", s3.url(), "--node-name", "node-a", env=s3.env, config=CONFIG) as d:
            procs = _ranks(d, "bench-job", 2.0)
            try:
                wait_for(lambda: s3.keys("hw/jobs/"), 60, "the job incident in the store", every=0.1)
                key = s3.keys("hw/jobs/")[0]
                manifest = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())
                hung = next(e for e in d.logs() if e.get("event") == "process_hung")
                declared = datetime.datetime.fromisoformat(hung["timestamp"].replace("Z", "+00:00")).timestamp()
                together = manifest["uploaded"] - declared
                ranks = manifest["ranks"]
                fr_files = sum(1 for f in manifest["files"] if f["path"].endswith("flight-recorder.pkl"))
            finally:
                stop(*procs)
        # One after another: the same steps on eight fresh ranks, in this process.
        with ScratchDaemon(base / "serial", config={**CONFIG, "heartbeat_timeout": 3600.0}) as d:
            procs = _ranks(d, "bench-serial", 3600.0)
            try:
                pids = wait_for(lambda: _workload_pids(d) if len(_workload_pids(d)) == RANKS else None, 30, "eight registrations")
                time.sleep(1.5)  # past their beats: hung, as the others were
                cfg = config.load(None, {**CONFIG, "state_dir": str(base / "serial" / "state"),
                                         "runtime_dir": str(d.runtime_dir)})
                # The progress step only waits over a 1 s window, beside the others in the daemon: one
                # after another it would add a second per rank that no capture spends. Left out.
                steps = [(s, t) for s, t in make_steps(cfg) if s.name != "progress"]
                start = time.monotonic()
                for pid in pids:
                    reg = registration_file.from_proc(pid)
                    assert reg is not None
                    run_steps(steps, reg, base / "serial-out" / str(pid), Deadline.after(cfg.capture_timeout))
                serial = time.monotonic() - start
            finally:
                stop(*procs)
    report("job_capture", [
        Figure(f"{RANKS} ranks of one job on one node (CPU stand-ins, flight recorders over real FIFOs), hang declared "
               "to the job incident in the store", f"{together:.2f} s ({len(ranks)} ranks, {fr_files} flight-recorder dumps)",
               f"the same steps one rank after another, capture alone: {serial:.2f} s", f"within {TARGET:g} s",
               together <= TARGET and len(ranks) == RANKS),
    ], note="store: moto's S3 server on loopback")

if __name__ == "__main__":
    main()
