"""Discovery: how soon a new GPU process is found, and what looking costs, on a node of 200 processes.

    python bench/discovery.py [--seconds 20]

200 processes run (sleepers, and 8 old "GPU processes" holding 300 fds each, as a
training rank does); the discovery thread (watch/discovery.py) looks every second
for DURATION seconds while a new process opens the stand-in device every 2 s. Figures:
its CPU time as a share of one core (target < 1 %), and from a process opening the
device to its being found (target within 5 s). The baseline in the same run: the full
scan (every fd of every process, what the 30 s rescan does), timed here, and what it
would cost at the same 1 s interval. NVML's process lists are included where there is
NVML (the figure says how many GPUs); on a CPU box there are none.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd.host import procfs  # noqa: E402 - after sys.path is set
from hangwatchd.watch.discovery import Discovery, holders  # noqa: E402 - after sys.path is set

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, Spread, judged, report  # noqa: E402 - after sys.path is set

PROCESSES = 200
OLD_GPU = 8
FDS = 300
WINDOW = 4.0  # seconds of each CPU-share window (its spread is the figure's noise)
CPU_TARGET = 1.0  # % of one core
FOUND_TARGET = 5.0  # seconds


def gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = int(pynvml.nvmlDeviceGetCount())
        pynvml.nvmlShutdown()
        return n
    except Exception:  # noqa: BLE001 - no NVML here
        return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=20.0)
    a = p.parse_args()
    started: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        device = Path(tmp) / "nvidia-stand-in0"
        device.write_text("")
        holder = (f"import time\nfs = [open({str(device)!r}) for _ in range({FDS})]\nprint(1, flush=True)\ntime.sleep(3600)\n")
        try:
            for _ in range(OLD_GPU):
                started.append(subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE))
            for proc in started:
                assert proc.stdout is not None
                proc.stdout.readline()
            started += [subprocess.Popen(["sleep", "3600"]) for _ in range(PROCESSES - OLD_GPU)]
            time.sleep(1.0)
            # The baseline: the full scan, timed (CPU of this thread) five times.
            full = []
            for _ in range(5):  # the scan the rescan ran before (procfs.gpu_processes: every fd of every process)
                t = time.thread_time()
                procfs.gpu_processes()
                full.append(time.thread_time() - t)
            assert len([q for q in started if q.pid in holders(str(device))]) == OLD_GPU
            full_s = Spread(tuple(full))
            d = Discovery(str(device), 1.0, young=60.0)
            d.scan()  # what runs now is the daemon's first full scan's: the thread starts after it
            d.seconds = 0.0
            d.start()
            opened: dict[int, float] = {}
            windows: list[float] = []  # % of a core in each window of WINDOW seconds
            mark = (time.monotonic(), d.seconds)
            lags: list[float] = []
            scans: list[float] = []  # the full scan's wall time, run once after each was found
            begin = time.monotonic()
            try:
                while time.monotonic() - begin < a.seconds:
                    q = subprocess.Popen([sys.executable, "-c", f"import time\ntime.sleep(0.5)\nf = open({str(device)!r})\n"
                                          "print(time.time(), flush=True)\ntime.sleep(3600)\n"], stdout=subprocess.PIPE)
                    started.append(q)
                    assert q.stdout is not None
                    opened[q.pid] = float(q.stdout.readline())
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:
                        if q.pid in d.reported:
                            lags.append(time.time() - opened[q.pid])
                            t = time.monotonic()
                            assert q.pid in holders(str(device))
                            scans.append(time.monotonic() - t)
                            break
                        time.sleep(0.02)
                    else:
                        lags.append(float("inf"))
                    time.sleep(max(0.0, 2.0 - (time.time() - opened[q.pid])))
                    if time.monotonic() - mark[0] >= WINDOW:
                        windows.append(100 * (d.seconds - mark[1]) / (time.monotonic() - mark[0]))
                        mark = (time.monotonic(), d.seconds)
                elapsed = time.monotonic() - begin
            finally:
                d.stop()
        finally:
            for q in started:
                q.kill()
                q.wait()
    cpu = 100 * d.seconds / elapsed
    full_cpu = 100 * full_s.median / 1.0
    gpus = gpu_count()
    by_window = Spread(tuple(windows or [cpu]))
    ok, noisy = judged(cpu, by_window.spread, CPU_TARGET)
    lag = Spread(tuple(lags))
    report("discovery", [
        Figure(f"the discovery thread looking every 1 s, {PROCESSES} processes ({OLD_GPU} holding {FDS} fds each), "
               f"{gpus} GPUs' NVML lists", f"{cpu:.2f}% of one core over {elapsed:.0f} s ({len(windows)} windows of "
               f"{WINDOW:g} s: {by_window.text('%', 2)})",
               f"the rescan's full scan of every fd: {full_s.text('s', 4)} a scan, {full_cpu:.1f}% of a core at the same interval",
               f"< {CPU_TARGET:g}%", ok, noisy),
        Figure("a new process opening the device to its being found", f"max {max(lags):.2f} s, median {lag.median:.2f} s "
               f"({len(lags)} processes)", f"one full scan: {Spread(tuple(scans)).text()} (found only when it runs: "
               "every rescan_interval, 30 s by default)",
               f"within {FOUND_TARGET:g} s", max(lags) <= FOUND_TARGET),
    ], note="CPU time of the discovery thread itself (thread_time); the stand-in device is a regular file")


if __name__ == "__main__":
    main()
