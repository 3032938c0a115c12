"""1,000 registered processes beating at 1 Hz on one node, each its own: what admitting them costs the
daemon's loop, what one state change costs, and the daemon's CPU and memory while they beat, with
timeouts it learns from their beats against the same processes with declared timeouts.

A real daemon (``hangwatchd daemon``) and 1,000 real processes, each registered the way
``hangwatchd run`` registers its child (a registration file and a beat segment, staged, then renamed
in) and each beating into its own segment once a second, as ``hangwatchd.beat()`` does (one
``pack_into`` of a count and a monotonic timestamp), their beats spread over the second. They are
forked from one small launcher, so 1,000 of them fit in a 2-core box's memory (each shares the
launcher's pages until it writes). Two daemons in turn over the same number of processes: one
whose processes declared a heartbeat timeout of 10 s (the baseline) and one whose processes
declared none (learned: 10 times the longest recent interval, 10 s here), measured once each
timeout is learned. The loop's time is its thread's CPU time (``hangwatchd_loop_cpu_seconds_total``);
a state change is timed on the daemon's ``Watchlist`` in this process, among 1,000 watched.
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

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd import log  # noqa: E402 - after sys.path is set
from hangwatchd.host import procfs  # noqa: E402 - after sys.path is set
from hangwatchd.metrics import create  # noqa: E402 - after sys.path is set
from hangwatchd.model import Registration, State, Suspicion  # noqa: E402 - after sys.path is set
from hangwatchd.testing import ScratchDaemon, wait_for  # noqa: E402 - after sys.path is set
from hangwatchd.watch.watched import Watched, Watchlist  # noqa: E402 - after sys.path is set

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, judged, report  # noqa: E402 - after sys.path is set

TARGET_ADMIT = 1.0  # seconds of loop time to admit them all
TARGET_CHANGE = 1e-3  # seconds per state change
TARGET_CPU = 2.0  # per cent of one core while they beat, timeouts learned
TARGET_RSS = 60.0  # MB
DECLARED = 10.0  # the baseline's declared heartbeat timeout: what is learned from beats a second apart


def loop_seconds(d: ScratchDaemon) -> float:
    """CPU time of the daemon's loop thread: its own work (the wall time of its turns also holds
    waits for the GIL and the CPU, which on a 2-core box shared with this bench is most of it)."""
    return d.metric("hangwatchd_loop_cpu_seconds_total") or 0.0


def loop_wall(d: ScratchDaemon) -> float:
    return d.metric("hangwatchd_loop_iteration_duration_seconds_sum") or 0.0


def watched(d: ScratchDaemon, state: str) -> float:
    return d.metric("hangwatchd_watched_processes", state=state) or 0.0


# Forks ``n`` beaters: each makes its beat segment, stages its registration (``timeout`` 0: none
# declared) and prints its pid, then beats once a second, its phase a k/n of the second.
LAUNCHER = r"""
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[5])
from hangwatchd.host import procfs
from hangwatchd.model import Registration
from hangwatchd.workload import beat_segment, registration_file

runtime, staging, n, timeout = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) or None

def beater(k):
    me = procfs.identify(os.getpid())
    beat_file = runtime / "beats" / f"{me.pid}-{me.start_time}.beat"
    beat_segment.create(str(beat_file), me.pid)
    mm, counter = beat_segment.open_for_writing(str(beat_file))
    pack, offset = beat_segment.BEAT.pack_into, beat_segment.BEAT_OFFSET
    pack(mm, offset, next(counter), time.monotonic_ns())
    registration_file.write(staging, Registration(
        process=me, uid=os.getuid(), job=None, heartbeat_timeout=timeout, beat_file=str(beat_file),
        cmdline=("beater",), source="register", registered_at=time.time()))
    os.write(1, b"%d\n" % me.pid)
    at = time.monotonic() + k / n
    while True:
        time.sleep(max(0.0, at - time.monotonic()))
        pack(mm, offset, next(counter), time.monotonic_ns())
        at += 1.0

for k in range(n):
    if os.fork() == 0:
        try:
            beater(k)
        finally:
            os._exit(0)
signal.pause()
"""


class Fleet:
    """N processes, each beating into its own segment once a second; registered when ``register`` says."""

    def __init__(self, runtime: Path, n: int, timeout: float | None) -> None:
        self.runtime = runtime
        self.staging = runtime / "staging"
        self.staging.mkdir(exist_ok=True)
        self.launcher = subprocess.Popen(
            [sys.executable, "-S", "-c", LAUNCHER, str(runtime), str(self.staging), str(n), str(timeout or 0), str(ROOT)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        assert self.launcher.stdout is not None
        pids = [self.launcher.stdout.readline() for _ in range(n)]
        if not all(p.strip() for p in pids):
            self.stop()
            raise SystemExit(f"only {sum(1 for p in pids if p.strip())} of {n} beaters started")
        self.staged = sorted(self.staging.iterdir())
        assert len(self.staged) == n

    def register(self, first: int, last: int) -> None:
        """Registrations arrive at once (renamed in, as the client's atomic write does)."""
        for path in self.staged[first:last]:
            path.rename(self.runtime / "registrations" / path.name)

    def private_mb(self) -> float:
        """The beaters' own memory (what each wrote since the fork), all of them together."""
        total = 0
        for child in psutil.Process(self.launcher.pid).children():
            try:
                total += child.memory_full_info().uss
            except psutil.Error:
                pass
        return total / 2**20

    def stop(self) -> None:
        try:
            os.killpg(self.launcher.pid, 9)
        except ProcessLookupError:
            pass
        self.launcher.wait()


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


def run_daemon(n: int, timeout: float | None, steady: float, learn: float) -> dict[str, float]:
    """One daemon watching ``n`` beaters (``timeout``: each one's declared heartbeat timeout; None:
    learned): admission, then its CPU and memory over ``steady`` seconds once ``learn`` have passed."""
    small = max(1, n // 10)
    config = {"max_registrations_per_uid": n + 10, "startup_grace": 60.0, "discover": False, "rescan_interval": 60.0}
    with tempfile.TemporaryDirectory() as t:
        d = ScratchDaemon(Path(t) / "d", config=config)
        fleet = None
        try:
            fleet = Fleet(d.runtime_dir, n, timeout)
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
            wait_for(lambda: watched(d, "healthy") >= n, 90, f"{n} processes healthy", every=0.5)
            admit = loop_seconds(d) - before
            admit_turns = loop_wall(d) - wall_before
            admit_wall = time.monotonic() - t0

            # Steady: once each timeout is learned (learn_min_beats beats at 1 Hz, and a margin).
            time.sleep(max(0.0, t0 + learn - time.monotonic()))
            c0, w0, l0 = sum(daemon.cpu_times()[:2]), time.monotonic(), loop_seconds(d)
            time.sleep(steady)
            span = time.monotonic() - w0
            cpu = (sum(daemon.cpu_times()[:2]) - c0) / span * 100
            loop_share = (loop_seconds(d) - l0) / span * 100
            rss = daemon.memory_info().rss / 2**20
            hung = watched(d, "hung") + watched(d, "suspect")
            timeouts = applied_timeouts(d)
            beaters_mb = fleet.private_mb()
        finally:
            if fleet is not None:
                fleet.stop()
            d.stop()
    return {"admit_small": admit_small, "admit": admit, "admit_turns": admit_turns, "admit_wall": admit_wall,
            "idle_cpu": idle_cpu, "cpu": cpu, "loop": loop_share, "rss": rss, "hung": hung, "beaters_mb": beaters_mb,
            **timeouts}


def applied_timeouts(d: ScratchDaemon) -> dict[str, float]:
    """How many processes have a learned timeout, and the range of the timeouts applied (status.json)."""
    data = json.loads((d.runtime_dir / "status.json").read_text())
    procs = data.get("processes", data) if isinstance(data, dict) else data
    learned = [p for p in procs if "learned" in str(p.get("timeout_source", ""))]
    values = [float(p["timeout"]) for p in procs if isinstance(p.get("timeout"), (int, float))]
    return {"learned": float(len(learned)), "timeout_min": min(values, default=0.0), "timeout_max": max(values, default=0.0)}


def three(values: list[float], fmt: str = ".2f") -> str:
    v = sorted(values)
    return "/".join(format(x, fmt) for x in (v[0], statistics.median(v), v[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=1000)
    p.add_argument("--steady", type=float, default=30.0, help="seconds of beating measured for CPU and memory")
    p.add_argument("--runs", type=int, default=3, help="runs of both daemons, in turns")
    args = p.parse_args()
    n = args.processes
    small = max(1, n // 10)
    learn = 20 + 10.0  # learn_min_beats beats at 1 Hz, then a margin

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

    declared: list[dict[str, float]] = []
    learned: list[dict[str, float]] = []
    for i in range(args.runs):
        declared.append(run_daemon(n, DECLARED, args.steady, learn))
        learned.append(run_daemon(n, None, args.steady, learn))
        print(f"scale: run {i + 1}: declared {declared[-1]}", flush=True)
        print(f"scale: run {i + 1}: learned {learned[-1]}", flush=True)

    def of(runs: list[dict[str, float]], key: str) -> list[float]:
        return [r[key] for r in runs]

    total = [r["admit_small"] + r["admit"] for r in learned]
    cpu, rss = of(learned, "cpu"), of(learned, "rss")
    cpu_ok, cpu_noisy = judged(statistics.median(cpu), max(cpu) - min(cpu), TARGET_CPU)
    hung = sum(of(learned, "hung")) + sum(of(declared, "hung"))
    r0 = learned[0]
    report("scale", [
        Figure(f"admitting {n} registered processes (the first {small}, then {n - small} at once): loop time in all",
               f"min/median/max of {len(learned)}: {three(total, '.3f')} s CPU (the {n - small}: {three(of(learned, 'admit'), '.3f')} s "
               f"CPU, {three(of(learned, 'admit_turns'))} s wall in the loop's turns, all healthy "
               f"{three(of(learned, 'admit_wall'), '.1f')} s after they appeared)",
               f"the first {small}: {three(of(learned, 'admit_small'), '.3f')} s (x{n / small:.0f})",
               f"< {TARGET_ADMIT:g} s", max(total) < TARGET_ADMIT),
        Figure(f"one state change, {n} watched", f"{per_change * 1e6:.0f} us",
               f"{small} watched: {per_change_small * 1e6:.0f} us", f"< {TARGET_CHANGE * 1e3:g} ms", per_change < TARGET_CHANGE),
        Figure(f"daemon CPU, {n} processes beating at 1 Hz, timeouts learned ({args.steady:g} s, "
               f"{r0['learned']:.0f} learned, {r0['timeout_min']:.1f}-{r0['timeout_max']:.1f} s)",
               f"{three(cpu)} % of a core (loop: {three(of(learned, 'loop'))} %)",
               f"the same with declared timeouts ({DECLARED:g} s): {three(of(declared, 'cpu'))} % (loop: "
               f"{three(of(declared, 'loop'))} %); watching nothing: {three(of(learned, 'idle_cpu'))} %",
               f"<= {TARGET_CPU:g} %", cpu_ok, cpu_noisy),
        Figure(f"daemon memory, {n} watched, timeouts learned", f"{three(rss, '.0f')} MB RSS",
               f"declared timeouts: {three(of(declared, 'rss'), '.0f')} MB", f"<= {TARGET_RSS:g} MB", max(rss) <= TARGET_RSS),
        Figure("processes taken for hung or suspect while beating", f"{hung:.0f}", "-", "0", hung == 0),
    ], note=f"{len(learned)} runs, each a daemon with declared timeouts then one with learned; {n} processes forked "
            "from one launcher, each registered like `hangwatchd run`'s child and beating into its own segment once a "
            f"second (together {three(of(learned, 'beaters_mb'), '.0f')} MB of their own); a state change timed on the "
            "daemon's Watchlist in-process, its log line rendered to /dev/null; this 2-core machine, shared with other "
            "work while measured",
       command=f"python bench/scale.py --processes {n} --runs {len(learned)}")


if __name__ == "__main__":
    main()
