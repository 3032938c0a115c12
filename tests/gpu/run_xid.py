"""XID events on a real GPU, through the real daemon (never in CI): run as root on a GPU machine with torch.

    PYTHONPATH=. python3 tests/gpu/run_xid.py OUTDIR [--gpu 0]

No tool makes the driver report an XID that needs a reset (79, 48, 74, 94, 95, 119: those take
failing hardware); an illegal memory access does make it report XID 31 (or 13/43), a job's own
error, as NVML's XidCriticalError event and as an NVRM Xid line in the kernel log naming the process. So:

1. the daemon starts; its GPU-event thread finds the GPUs (their XID series exist at 0) and its
   kernel log reader follows /dev/kmsg;
2. rank 0 (``hangwatchd run --rank 0``) holds the GPU, beats, then hangs on the host;
3. another process on the same GPU faults (tests/fixtures/gpu/graph_ima/graph_ima.py);
4. rank 0's incident holds ``PID/gpu-events.json`` with that XID and the faulting process's pid (from
   the kernel log), and its verdict says it was another process's own fault, never the cause of the
   hang ("Another process on GPU 0, pid N (...), hit XID 31 ..."); the XID is counted once
   (``hangwatchd_gpu_xid_errors_total{gpu="0",xid="31"}``, NVML's event and the kernel's line one),
   the incident blames no GPU, and ``hangwatchd health`` still exits 0 (a job's own error is not the
   node's fault).

Prints OUTDIR/summary.json; exits 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, stop, wait_for  # noqa: E402

RANK = """
import threading, time, torch, hangwatchd
x = torch.ones(1024, device="cuda")
for _ in range(20):
    x += 1; torch.cuda.synchronize(); hangwatchd.beat(); time.sleep(0.05)
print("stopped", time.time(), flush=True)
threading.Event().wait()
"""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("outdir", type=Path)
    p.add_argument("--gpu", default="0")
    a = p.parse_args()
    a.outdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, lambda *_: sys.exit("run_xid: over its 300 s deadline"))
    signal.alarm(300)
    base = Path("/tmp/hangwatchd-xid")
    subprocess.run(["rm", "-rf", str(base)], check=False)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=a.gpu)
    result: dict[str, Any] = {}
    procs: list[subprocess.Popen[bytes]] = []
    d = ScratchDaemon(base, config={"gpu_dump": "never", "capture_steps": ["proc", "pyspy", "nvml"], "pyspy_native": False})
    try:
        gpu = int(a.gpu)
        wait_for(lambda: d.metric("hangwatchd_gpu_xid_errors_total", gpu=str(gpu), xid="31") == 0.0, 30,
                 "the daemon's GPU-event thread listening (XID series at 0)")
        rank = d.run([sys.executable, "-c", RANK], "--rank", "0", "--heartbeat-timeout", "8", env=env, stdout=subprocess.PIPE)
        procs.append(rank)
        assert rank.stdout is not None
        stopped = float(rank.stdout.readline().split()[1])
        fault = subprocess.Popen([sys.executable, str(ROOT / "tests/fixtures/gpu/graph_ima/graph_ima.py")], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        fault.communicate(timeout=120)
        result["faulting_process"] = {"pid": fault.pid, "exit": fault.returncode}
        xids = wait_for(lambda: [ln for ln in d.scrape().splitlines() if ln.startswith("hangwatchd_gpu_xid_errors_total")
                                 and not ln.endswith(" 0.0")], 60, "an XID counted")
        result["xid_series"] = xids
        (inc,) = wait_for(d.store().list, 60, "rank 0's incident")
        files = list(Path(inc["dir"]).rglob("gpu-events.json"))
        result["gpu_events"] = json.loads(files[0].read_text()) if files else None
        result["summary"] = inc["summary"]
        h = subprocess.run(hangwatchd_argv("health", "--runtime-dir", str(d.runtime_dir)), capture_output=True, text=True, timeout=30)
        result["health"] = {"exit": h.returncode, "line": h.stdout.strip()}
        result["stopped"] = stopped
        events = (result["gpu_events"] or {}).get("events") or []
        record = json.loads((Path(inc["dir"]) / "incident.json").read_text())
        result["checks"] = {
            "xid_counted": bool(xids),
            "gpu_events_in_incident": bool(events),
            "xid_names_the_faulting_process": any(e.get("pid") == fault.pid and e.get("own") is False for e in events),
            "verdict_says_it_was_another_process": f"nother process on GPU {gpu}, pid {fault.pid}" in inc["summary"]
            and "a GPU fault" not in inc["summary"],
            "no_gpu_blamed": not (record.get("analysis") or {}).get("blame"),
            "health_ok_for_a_jobs_error": h.returncode == 0 or any(x in h.stdout for x in ("XID 79", "XID 48", "lost")),
        }
    finally:
        for pr in procs:
            stop(pr, sig=signal.SIGKILL)
        d.stop()
        (a.outdir / "daemon.log").write_bytes((base / "daemon.log").read_bytes())
    (a.outdir / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
