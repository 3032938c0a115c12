"""The daemon on a busy node, each figure against a baseline measured in the same run.

1. CPU and memory of the daemon watching 64 processes beating at 10 Hz, against the
   same daemon watching none (target: under 2% of one core, under 80 MB).
2. Slowdown of a busy 32-thread Python workload under frozen-stack sampling at the
   default rate (one plain py-spy dump every 5 s), against the same workload unwatched
   (target: under 1%).
3. Eight processes hanging at once: all captured and stored (target: within 10 s).
4. Time from a process's last change of stack to its `stack` incident (declared
   --stack-timeout 10 s, default sampling interval).
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

from hangwatchd.testing import Daemon, wait_for, workload_argv  # noqa: E402

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


def daemon_load(tmp: Path) -> None:
    with Daemon(tmp / "load", config={"pyspy_native": False}) as d:
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
    print(f"1. daemon, 64 processes at 10 Hz: {cpu:.2f}% of one core, {rss:.0f} MB RSS "
          f"(watching none: {idle_cpu:.2f}%, {idle_rss:.0f} MB; target < 2%, < 80 MB)")


def sampling_slowdown(tmp: Path) -> None:
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
    print(f"2. 32-thread workload sampled every {interval:g} s: {on:.0f} units/s, unsampled windows {off:.0f} units/s: "
          f"slowdown {100 * (off - on) / off:+.2f}% (target < 1%; 6 windows of 10 s each way, alternating)")


def eight_at_once(tmp: Path) -> None:
    with Daemon(tmp / "eight", config={"pyspy_native": False, "gpu_dump": "never"}) as d:
        procs = [d.run(workload_argv(beats=20, interval=0.05), "--heartbeat-timeout", "3", stdout=subprocess.PIPE)
                 for _ in range(8)]
        try:
            for p in procs:
                assert p.stdout is not None
                p.stdout.readline()
            last = time.time()
            wait_for(lambda: len(d.store().list()) == 8, 60, "8 incidents", every=0.1)
            done = max(float(e["seconds"]) for e in d.logs() if e.get("event") == "incident_stored")
        finally:
            for p in procs:
                p.kill()
                p.wait()
    print(f"3. eight hanging at once: all 8 stored {time.time() - last:.1f} s after the last beat "
          f"(timeout 3 s; slowest capture {done:.2f} s; target: within 10 s)")


def stack_latency(tmp: Path) -> None:
    code = ("import time, threading\nfor i in range(40): time.sleep(0.05 + i * 0.0001)\n"
            "print(time.time(), flush=True)\nlock = threading.Lock(); lock.acquire(); lock.acquire()\n")
    with Daemon(tmp / "stack", config={"pyspy_native": False, "gpu_dump": "never"}) as d:
        p = d.run([sys.executable, "-c", code], "--stack-timeout", "10", "--heartbeat-timeout", "3600", stdout=subprocess.PIPE)
        try:
            assert p.stdout is not None
            changed = float(p.stdout.readline())
            (inc,) = wait_for(d.store().list, 60, "a stack incident", every=0.2)
        finally:
            p.kill()
            p.wait()
    print(f"4. last stack change to `stack` incident: {inc['time'] - changed:.1f} s "
          f"(declared --stack-timeout 10 s, one sample every 5 s: at most timeout + interval + capture)")


def main() -> None:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        daemon_load(tmp)
        sampling_slowdown(tmp)
        eight_at_once(tmp)
        stack_latency(tmp)


if __name__ == "__main__":
    main()
