"""The daemon on a busy node, each figure against a baseline measured in the same run.

1. CPU and memory of the daemon watching 64 processes beating at 10 Hz, against the
   same daemon watching none (target: under 2% of one core, under 80 MB).
2. Slowdown of a busy 32-thread Python workload under frozen-stack sampling at the
   default rate (one plain py-spy dump every 5 s), against the same workload unwatched
   (target: under 1%).
3. Eight processes hanging at once: all captured and stored (target: within 10 s).
4. Time from a process's last change of stack to its `stack` incident (declared
   --stack-timeout 10 s, default sampling interval; target: within timeout + interval + 1 s).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hangwatchd.testing import ScratchDaemon, wait_for, workload_argv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figures import Figure, judged, report

WINDOW = 30.0
BUSY = """
import threading, time
done = [0] * 32
def work(k):
    while True:
        x = 0
        for i in range(20_000):
            x += i * i
        done[k] += 1
for k in range(32):
    threading.Thread(target=work, args=(k,), daemon=True).start()
while True:
    time.sleep(0.5)
    print(time.monotonic(), sum(done), flush=True)
"""
def cpu_and_rss(pid: int, seconds: float) -> tuple[float, float]:
    p = psutil.Process(pid)
    t0 = sum(p.cpu_times()[:2])
    time.sleep(seconds)
    return (sum(p.cpu_times()[:2]) - t0) / seconds * 100, p.memory_info().rss / 2**20


def daemon_load(tmp: Path) -> Figure:
    with ScratchDaemon(tmp / "load", config={"pyspy_native": False}) as d:
        idle_cpu, idle_rss = cpu_and_rss(d.proc.pid, WINDOW / 3)
        env = dict(os.environ, HANGWATCHD_RUNTIME_DIR=str(d.runtime_dir))
        procs = [subprocess.Popen(workload_argv(beats=10**9, interval=0.1) + ["--register"], env=env,
                                  stdout=subprocess.DEVNULL) for _ in range(64)]
        try:
            wait_for(lambda: sum(1 for p in (d.runtime_dir / "registrations").glob("*.json")) == 64, 60, "64 registrations")
            time.sleep(3)
            cpu, rss = cpu_and_rss(d.proc.pid, WINDOW)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return Figure("the daemon watching 64 processes beating at 10 Hz", f"{cpu:.2f}% of one core, {rss:.0f} MB RSS",
                  f"watching none: {idle_cpu:.2f}%, {idle_rss:.0f} MB", "< 2%, < 80 MB", cpu < 2 and rss < 80)


def sampling_slowdown(tmp: Path) -> Figure:
    """One busy process; windows of 10 s alternate between sampled (as the daemon does, at its
    default rate) and not. The same process in both: only the sampling differs."""
    from hangwatchd.config import Config
    from hangwatchd.detect.stack import take_sample

    interval = Config().stack_interval
    proc = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    rates: dict[bool, list[float]] = {True: [], False: []}
    try:
        proc.stdout.readline()
        for window in range(12):
            sampled = window % 2 == 1
            start_t, start_n = map(float, proc.stdout.readline().split())
            end = start_t + 10
            next_sample = time.monotonic()
            while True:
                if sampled and time.monotonic() >= next_sample:
                    take_sample(proc.pid, 10)
                    next_sample += interval
                t, n = map(float, proc.stdout.readline().split())
                if t >= end:
                    break
            rates[sampled].append((n - start_n) / (t - start_t))
    finally:
        proc.kill()
        proc.wait()
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    slowdown = 100 * (off - on) / off
    # The noise: how far the unsampled windows alone differ from each other. A slowdown within it
    # (a negative one too) says nothing either way: no verdict, and the table says so.
    noise = 100 * (max(rates[False]) - min(rates[False])) / off
    ok, noisy = judged(slowdown, noise, 1.0)
    return Figure(f"a busy 32-thread Python workload sampled every {interval:g} s (6 windows of 10 s each way)",
                  f"{on:.0f} units/s: {slowdown:+.2f}% slowdown (noise between unsampled windows: {noise:.2f}%)",
                  f"its unsampled windows: {off:.0f} units/s", "< 1%", ok, noisy)


def eight_at_once(tmp: Path) -> Figure:
    with ScratchDaemon(tmp / "eight", config={"pyspy_native": False, "gpu_dump": "never"}) as d:
        # The baseline: one process hanging alone, same daemon, same timeout.
        one = d.run(workload_argv(beats=20, interval=0.05), "--heartbeat-timeout", "3", stdout=subprocess.PIPE)
        try:
            assert one.stdout is not None
            one.stdout.readline()
            alone_last = time.time()
            wait_for(lambda: len(d.settled()) == 1, 60, "1 incident", every=0.1)
            alone = time.time() - alone_last
        finally:
            one.kill()
            one.wait()
        procs = [d.run(workload_argv(beats=20, interval=0.05), "--heartbeat-timeout", "3", stdout=subprocess.PIPE)
                 for _ in range(8)]
        try:
            for p in procs:
                assert p.stdout is not None
                p.stdout.readline()
            last = time.time()
            wait_for(lambda: len(d.settled()) == 9, 60, "8 more incidents", every=0.1)
            wait_for(lambda: sum(e.get("event") == "incident_stored" for e in d.logs()) == 9, 10, "the loop's 9 incident_stored")
            done = max(float(e["seconds"]) for e in d.logs() if e.get("event") == "incident_stored")
        finally:
            for p in procs:
                p.kill()
                p.wait()
    took = time.time() - last
    return Figure("eight processes hanging at once (timeout 3 s)", f"all 8 stored {took:.1f} s after the last beat "
                  f"(slowest capture {done:.2f} s)", f"one process hanging alone: stored {alone:.1f} s after its last beat",
                  "within 10 s", took <= 10)


def seconds_to_incident(base: Path, code: str, *options: str) -> float:
    """Seconds from the time ``code`` prints (its last beat, or its stack's last change) to its incident,
    under a daemon of its own."""
    with ScratchDaemon(base, config={"pyspy_native": False, "gpu_dump": "never"}) as d:
        p = d.run([sys.executable, "-c", code], *options, stdout=subprocess.PIPE)
        try:
            assert p.stdout is not None
            printed = float(p.stdout.readline())
            (inc,) = wait_for(d.settled, 60, "an incident", every=0.2)
        finally:
            p.kill()
            p.wait()
    return float(inc["time"]) - printed


def stack_latency(tmp: Path) -> Figure:
    code = ("import time, threading\nfor i in range(40): time.sleep(0.05 + i * 0.0001)\n"
            "print(time.time(), flush=True)\nlock = threading.Lock(); lock.acquire(); lock.acquire()\n")
    # The baseline: the same hang found by the other signal, a heartbeat, under the same 10 s.
    beats = ("import time, threading, hangwatchd\nfor i in range(40): time.sleep(0.05); hangwatchd.beat()\n"
             "print(time.time(), flush=True)\nlock = threading.Lock(); lock.acquire(); lock.acquire()\n")
    by_beat = seconds_to_incident(tmp / "beat", beats, "--heartbeat-timeout", "10")
    took = seconds_to_incident(tmp / "stack", code, "--stack-timeout", "10", "--heartbeat-timeout", "3600")
    return Figure("last change of stack to `stack` incident (--stack-timeout 10)", f"{took:.1f} s",
                  f"the same hang by its heartbeat (timeout 10 s): {by_beat:.1f} s", "within 16 s", took <= 16)


def main() -> None:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        report("stress", [daemon_load(tmp), sampling_slowdown(tmp), eight_at_once(tmp), stack_latency(tmp)])


if __name__ == "__main__":
    main()
