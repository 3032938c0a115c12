"""1,000 registered processes beating at 1 Hz on one node: what admitting them costs the daemon's
loop, what one state change costs, and the daemon's CPU and memory while they beat.

A real daemon (``hangwatchd daemon``) and 1,000 real processes (``sleep``, each registered the
way ``hangwatchd run`` registers its child: a registration file and a beat segment); this bench
beats into each segment once a second on their behalf (what ``hangwatchd.beat()`` writes: a
count and a monotonic timestamp), so 1,000 Python interpreters need not fit in a 2-core box.
The loop's time is its thread's CPU time (``hangwatchd_loop_cpu_seconds_total``); a
state change is timed on the daemon's ``Watchlist`` in this process, among 1,000 watched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd import log  # noqa: E402 - after sys.path is set
from hangwatchd.host import procfs  # noqa: E402 - after sys.path is set
from hangwatchd.metrics import create  # noqa: E402 - after sys.path is set
from hangwatchd.model import Registration, State, Suspicion  # noqa: E402 - after sys.path is set
from hangwatchd.testing import ScratchDaemon, wait_for  # noqa: E402 - after sys.path is set
from hangwatchd.watch.watched import Watched, Watchlist  # noqa: E402 - after sys.path is set
from hangwatchd.workload import beat_segment, registration_file  # noqa: E402 - after sys.path is set

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, report  # noqa: E402 - after sys.path is set

TARGET_ADMIT = 1.0  # seconds of loop time to admit them all
TARGET_CHANGE = 1e-3  # seconds per state change
TARGET_CPU = 5.0  # per cent of one core while they beat
TARGET_RSS = 150.0  # MB


def loop_seconds(d: ScratchDaemon) -> float:
    """CPU time of the daemon's loop thread: its own work (the wall time of its turns also holds
    waits for the GIL and the CPU, which on a 2-core box shared with this bench is most of it)."""
    return d.metric("hangwatchd_loop_cpu_seconds_total") or 0.0


def loop_wall(d: ScratchDaemon) -> float:
    return d.metric("hangwatchd_loop_iteration_duration_seconds_sum") or 0.0


def watched(d: ScratchDaemon, state: str) -> float:
    return d.metric("hangwatchd_watched_processes", state=state) or 0.0


class Fleet:
    """N ``sleep`` processes, registered, with a beat segment each that this process beats into."""

    def __init__(self, runtime: Path, n: int) -> None:
        self.runtime = runtime
        sleep = shutil.which("sleep") or "/bin/sleep"
        self.procs = [subprocess.Popen([sleep, "3600"]) for _ in range(n)]
        self.segments: list[tuple[Any, Any]] = []  # (the mmap, its beat counter)
        self.ids = [procfs.identify(p.pid) for p in self.procs]

    def prepare(self) -> None:
        """Beat segments (each beaten once) and registration files, staged beside the registrations dir."""
        staging = self.runtime / "staging"
        staging.mkdir(exist_ok=True)
        self.staged: list[Path] = []
        for me in self.ids:
            assert me is not None
            beat_file = self.runtime / "beats" / f"{me.pid}-{me.start_time}.beat"
            beat_segment.create(str(beat_file), me.pid)
            self.segments.append(beat_segment.open_for_writing(str(beat_file)))
            self.beat_one(len(self.segments) - 1)
            self.staged.append(registration_file.write(staging, Registration(
                process=me, uid=os.getuid(), job=None, beat_file=str(beat_file), cmdline=("sleep", "3600"),
                source="register", registered_at=time.time())))

    def register(self, first: int, last: int) -> None:
        """Registrations arrive at once (renamed in, as the client's atomic write does)."""
        for path in self.staged[first:last]:
            path.rename(self.runtime / "registrations" / path.name)

    def beat_one(self, i: int) -> None:
        mm, counter = self.segments[i]
        beat_segment.BEAT.pack_into(mm, beat_segment.BEAT_OFFSET, next(counter), time.monotonic_ns())

    def beat_for(self, seconds: float) -> None:
        """Every segment beats once a second, spread over the second."""
        end = time.monotonic() + seconds
        n = len(self.segments)
        while time.monotonic() < end:
            start = time.monotonic()
            for i in range(n):
                self.beat_one(i)
                if i % 50 == 49:
                    time.sleep(max(0.0, start + (i + 1) / n - time.monotonic()))
            time.sleep(max(0.0, start + 1.0 - time.monotonic()))

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def change_cost(n: int, changes: int = 20_000) -> float:
    """Seconds per state change on the daemon's Watchlist with ``n`` watched (logging rendered to /dev/null)."""
    metrics = create(node="bench")
    lst = Watchlist(metrics, on_change=lambda: None)
    me = procfs.identify(os.getpid())
    assert me is not None
    ws = []
    for i in range(n):
        reg = Registration(process=type(me)(1_000_000 + i, i), uid=0, beat_file="x")
        w = Watched(reg, State.HEALTHY, seen_at=0.0, timeout=10.0)
        lst.admit(w)
        ws.append(w)
    why = Suspicion("heartbeat", "bench", 0.0)
    start = time.perf_counter()
    for k in range(changes // 2):
        w = ws[k % n]
        lst.change(w, State.SUSPECT, why="bench", suspicion=why, confirm_by=1.0, check_at=1.0)
        lst.change(w, State.HEALTHY, why="bench", check_at=2.0)
    return (time.perf_counter() - start) / changes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--processes", type=int, default=1000)
    p.add_argument("--steady", type=float, default=30.0, help="seconds of beating measured for CPU and memory")
    args = p.parse_args()
    n = args.processes
    small = max(1, n // 10)

    # The state change, in this process, among n watched and among n/10 (the baseline: it must not grow with n).
    null = open(os.devnull, "w")
    saved, sys.stderr = sys.stderr, null
    try:
        log.configure("json", "info")
        per_change = change_cost(n)
        per_change_small = change_cost(small)
    finally:
        sys.stderr = saved
    log.configure("console", "warning")

    config = {"max_registrations_per_uid": n + 10, "heartbeat_timeout": 30.0, "startup_grace": 60.0,
              "discover": False, "rescan_interval": 60.0}
    with tempfile.TemporaryDirectory() as t:
        d = ScratchDaemon(Path(t) / "d", config=config)
        fleet = Fleet(d.runtime_dir, n)
        try:
            fleet.prepare()
            daemon = psutil.Process(d.proc.pid)
            # Baseline: the daemon watching nothing, for a while.
            c0, w0 = sum(daemon.cpu_times()[:2]), time.monotonic()
            time.sleep(5)
            idle_cpu = (sum(daemon.cpu_times()[:2]) - c0) / (time.monotonic() - w0) * 100

            # Admission: first n/10 (the baseline, per process), then the rest.
            before = loop_seconds(d)
            fleet.register(0, small)
            wait_for(lambda: watched(d, "healthy") >= small, 60, "the first processes healthy", every=1.0)
            admit_small = loop_seconds(d) - before
            before, wall_before = loop_seconds(d), loop_wall(d)
            t0 = time.monotonic()
            fleet.register(small, n)
            while watched(d, "healthy") < n:
                fleet.beat_for(1.0)
                if time.monotonic() - t0 > 90:
                    raise SystemExit(f"only {watched(d, 'healthy'):.0f} of {n} healthy after 90 s")
            admit = loop_seconds(d) - before
            admit_turns = loop_wall(d) - wall_before
            admit_wall = time.monotonic() - t0

            # Steady: n processes beating at 1 Hz.
            fleet.beat_for(3.0)  # past the admission's tail
            c0, w0, l0 = sum(daemon.cpu_times()[:2]), time.monotonic(), loop_seconds(d)
            fleet.beat_for(args.steady)
            span = time.monotonic() - w0
            cpu = (sum(daemon.cpu_times()[:2]) - c0) / span * 100
            loop_share = (loop_seconds(d) - l0) / span * 100
            rss = daemon.memory_info().rss / 2**20
            hung = watched(d, "hung") + watched(d, "suspect")
        finally:
            fleet.stop()
            d.stop()

    total = admit_small + admit
    report("scale", [
        Figure(f"admitting {n} registered processes (the first {small}, then {n - small} at once): loop time in all",
               f"{total:.3f} s CPU (the {n - small}: {admit:.3f} s CPU, {admit_turns:.2f} s wall in the loop's turns, "
               f"all healthy {admit_wall:.1f} s after they appeared)",
               f"the first {small}: {admit_small:.3f} s (x{n / small:.0f} = {admit_small * n / small:.3f} s)",
               f"< {TARGET_ADMIT:g} s", total < TARGET_ADMIT),
        Figure(f"one state change, {n} watched", f"{per_change * 1e6:.0f} us",
               f"{small} watched: {per_change_small * 1e6:.0f} us", f"< {TARGET_CHANGE * 1e3:g} ms", per_change < TARGET_CHANGE),
        Figure(f"daemon CPU, {n} processes beating at 1 Hz ({args.steady:g} s)",
               f"{cpu:.1f} % of a core (loop: {loop_share:.1f} %)", f"watching nothing: {idle_cpu:.1f} %",
               f"< {TARGET_CPU:g} %", cpu < TARGET_CPU),
        Figure(f"daemon memory, {n} watched", f"{rss:.0f} MB RSS", "-", f"< {TARGET_RSS:g} MB", rss < TARGET_RSS),
        Figure("processes taken for hung or suspect while beating", f"{hung:.0f}", "-", "0", hung == 0),
    ], note=f"{n} `sleep` processes registered like `hangwatchd run`'s children, the bench beating for them; "
            "a state change timed on the daemon's Watchlist in-process, its log line rendered to /dev/null")


if __name__ == "__main__":
    main()
