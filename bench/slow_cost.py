"""What watching a job's pace costs: the daemon's CPU per watched rank, and the job's own pace.

A synchronous job of 8 ranks (tests/cause/pace_job.py, meeting at a TCP barrier every step,
each rank beating once a step) under a real daemon with ``slow_jobs = true`` (its default:
each rank's beat segment and counters read every few seconds, one ``py-spy dump
--nonblocking`` of each rank every ``slow_sample_interval``, 10 s) against the same job under
a daemon with ``slow_jobs = false``, in turns, in the same run. The daemon's CPU is its own and
its children's (py-spy), from /proc; the job's pace is its ranks' beats a second.

Target: under 0.2 % of one core per watched rank; the job's steps a second within 2 % of its
pace under the daemon that does not watch its pace.

    python bench/slow_cost.py [--seconds 90] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hangwatchd.testing import ScratchDaemon, stop, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figures import Figure, Spread, judged, report

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "cause" / "pace_job.py"
RANKS = 8
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """A process's CPU so far, its reaped children's (py-spy, the NVML probe) with it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICKS


def beats(d: ScratchDaemon) -> int:
    res = subprocess.run([sys.executable, "-m", "hangwatchd", "status", "--json", "--runtime-dir", str(d.runtime_dir)],
                         capture_output=True, text=True, timeout=30)
    return sum(p["beats"] for p in json.loads(res.stdout)["processes"] if p.get("job") == "paced")


def one_round(base: Path, pace_on: bool, seconds: float) -> tuple[float, float]:
    """(the daemon's CPU in % of a core, the job's steps a second) over ``seconds`` of a steady job."""
    config = {"slow_jobs": pace_on, "pyspy_native": False, "gpu_dump": "never"}
    base.mkdir(parents=True, exist_ok=True)
    control = base / "control.json"
    control.write_text("{}")
    from tests.s3server import free_port

    port = free_port()
    with ScratchDaemon(base / ("on" if pace_on else "off"), config=config) as d:
        procs = [d.run([sys.executable, str(JOB)], "--job", "paced", "--rank", str(r), "--heartbeat-timeout", "60",
                       env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                PACE_BACKEND="barrier", PACE_CONTROL=str(control), PACE_COMPUTE_S="0.002", PACE_DEVICE_S="0.1"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(RANKS)]
        try:
            wait_for(lambda: beats(d) >= RANKS * 100, 120, "the job stepping", every=1.0)
            if pace_on:  # its pace learned, as it is for days in the field
                wait_for(lambda: d.metric("hangwatchd_job_step_baseline_seconds", workload_job="paced"), 120, "its baseline", every=1.0)
            time.sleep(10)
            c0, b0, t0 = cpu_seconds(d.proc.pid), beats(d), time.monotonic()
            time.sleep(seconds)
            c1, b1, t1 = cpu_seconds(d.proc.pid), beats(d), time.monotonic()
        finally:
            stop(*procs)
    return (c1 - c0) / (t1 - t0) * 100, (b1 - b0) / RANKS / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=90.0, help="seconds each round is measured over")
    ap.add_argument("--rounds", type=int, default=2, help="rounds each way, taking turns")
    args = ap.parse_args()
    on: list[tuple[float, float]] = []
    off: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            off.append(one_round(Path(tmp) / f"off{i}", False, args.seconds))
            on.append(one_round(Path(tmp) / f"on{i}", True, args.seconds))
            print(f"round {i + 1}: off {off[-1][0]:.2f} % CPU, {off[-1][1]:.2f} steps/s; on {on[-1][0]:.2f} % CPU, "
                  f"{on[-1][1]:.2f} steps/s", flush=True)
    cpu_on, cpu_off = Spread(tuple(c for c, _ in on)), Spread(tuple(c for c, _ in off))
    added = (cpu_on.median - cpu_off.median) / RANKS
    ok, noisy = judged(added, (cpu_on.spread + cpu_off.spread) / RANKS, 0.2)
    steps_on, steps_off = statistics.median(s for _, s in on), statistics.median(s for _, s in off)
    slower = (steps_off - steps_on) / steps_off * 100
    report("slow_cost", [
        Figure(f"the daemon's CPU added per watched rank, a steady job of {RANKS} ranks (slow_jobs on, defaults)",
               f"{added:.3f} % of one core (the daemon: {cpu_on.text('%', 2)})",
               f"slow_jobs off: {cpu_off.text('%', 2)}", "< 0.2 % a rank", ok, noisy),
        Figure("the job's steps a second under the daemon that watches its pace", f"{steps_on:.2f} steps/s: {slower:+.1f} % slower",
               f"slow_jobs off: {steps_off:.2f} steps/s", "within 2 %", abs(slower) <= 2.0),
    ], note=f"{args.rounds} rounds of {args.seconds:g} s each way, taking turns; each rank 2 ms of compute and 100 ms "
            "of sleep a step; CPU from /proc (the daemon and its reaped children: py-spy)",
       command=f"python bench/slow_cost.py --seconds {args.seconds:g} --rounds {args.rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
