"""A slow rank on a GPU, through the real daemon: four ranks share one GPU, one launches more kernels.

    PYTHONPATH=. python3 tests/gpu/run_slow.py OUTDIR [--extra 24] [--fake]

Four ranks of one job (tests/cause/pace_job.py with PACE_DEVICE=cuda: each step a batch from a
DataLoader worker, a little compute, PACE_MATMULS matrix products on the GPU and a synchronize,
then gloo's all_reduce of a CPU tensor), each started by its own `hangwatchd run` and beating
once a step. Once the daemon has learned the job's pace, rank 2 launches --extra more products
each step. The daemon must file one `slow` incident naming rank 2 (its cause: it waits for its
own GPU work, more than the others; SM shares from NVML's per-process samples beside it), with
stacks and NVML only. Writes OUTDIR/result.json (the summary, the cause, the timings, the NVML
facts of the window), the daemon's log and the incident. --fake runs it without a GPU (a sleep
stands for the kernels, rank 2 gets extra compute instead), to check this script on a CPU machine.

Every wait has a deadline, the whole run has one (SIGALRM), and every process it started is
stopped with its process group at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, stop, wait_for  # noqa: E402
from tests.s3server import free_port  # noqa: E402

WHOLE_RUN = 540  # seconds: under the device tool's 600 s a command
RANKS = 4
CONFIG = {"slow_for": 20.0, "slow_margin": 0.12, "slow_sample_interval": 2.0, "pyspy_samples_per_uid": 20.0,
          "slow_window": 120.0, "gpu_dump": "never", "pyspy_native": False}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("outdir", type=Path)
    # The four ranks share the GPU, so a step's GPU time is all their products together (4 x 16): 6 more
    # is +9 %, under the margin; 24 more is +37 %, the job held back by rank 2's own kernels.
    p.add_argument("--extra", type=int, default=24, help="more matrix products rank 2 launches each step")
    p.add_argument("--fake", action="store_true", help="no GPU: check the runner itself")
    a = p.parse_args()

    def too_long(*_: object) -> None:
        raise TimeoutError(f"run_slow.py: past its {WHOLE_RUN} s deadline")

    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(WHOLE_RUN)
    a.outdir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="hangwatchd-slow-"))
    control = base / "control.json"
    control.write_text("{}")
    d = ScratchDaemon(base / "d", config=CONFIG)
    port = free_port()
    ranks: list[subprocess.Popen[bytes]] = []
    logs = []
    result: dict[str, Any] = {"fake": a.fake, "extra": a.extra}
    try:
        for r in range(RANKS):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK="0", WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), PACE_BACKEND="gloo" if not a.fake else "barrier", PACE_CONTROL=str(control),
                       PACE_COMPUTE_S="0.005", CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
            if not a.fake:
                env["PACE_DEVICE"] = "cuda"
            log = open(a.outdir / f"rank{r}.log", "wb")
            logs.append(log)
            ranks.append(d.run([sys.executable, str(ROOT / "tests" / "cause" / "pace_job.py")], "--job", "gpu-pace",
                               "--rank", str(r), "--heartbeat-timeout", "60", env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True))
        t0 = time.time()
        base_s = wait_for(lambda: d.metric("hangwatchd_job_step_baseline_seconds", workload_job="gpu-pace"), 240,
                          "the job's baseline", every=1.0)
        result["baseline_s"] = base_s
        result["baseline_after_s"] = round(time.time() - t0, 1)
        control.write_text(json.dumps({"kernels": {"2": a.extra}} if not a.fake else {"compute": {"2": 0.3 * base_s}}))
        t1 = time.time()
        inc = wait_for(lambda: [i for i in d.store().list() if i["reason"] == "slow"], 240, "the slow incident", every=1.0)[0]
        result["named_after_s"] = round(time.time() - t1, 1)
        meta = json.loads((Path(inc["dir"]) / "incident.json").read_text())
        analysis = meta.get("analysis") or {}
        result.update(summary=analysis.get("summary"), pace=analysis.get("pace"), culprits=analysis.get("culprits"),
                      steps=sorted({s["step"] for pr in meta.get("processes", []) for s in pr.get("steps", [])}),
                      step_s=d.metric("hangwatchd_job_step_seconds", workload_job="gpu-pace"))
        slow_json = json.loads((Path(inc["dir"]) / "slow.json").read_text())
        result["gpus"] = slow_json["records"][0].get("gpus")
        result["ranks"] = [{k: r.get(k) for k in ("rank", "samples", "collective", "gpu", "running", "cpu_s", "gpu_index", "frame")}
                           for r in slow_json["records"][0]["ranks"]]
        result["named_rank_2"] = bool(result["pace"]) and result["pace"].get("rank") == 2
        with tarfile.open(a.outdir / "incident.tar.xz", "w:xz") as tar:
            tar.add(inc["dir"], arcname="slow-incident")
    except Exception as exc:  # noqa: BLE001 - report what happened, then clean up
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
        for pr in ranks:
            stop(pr, group=True)
        for log in logs:
            log.close()
        d.stop()
        shutil.copy(d.log, a.outdir / "daemon.log")
        shutil.rmtree(base, ignore_errors=True)
    (a.outdir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str)[:6000])
    print("ok: rank 2 named" if result.get("named_rank_2") else "FAILED: rank 2 was not named")
    return 0 if result.get("named_rank_2") else 1


if __name__ == "__main__":
    sys.exit(main())
