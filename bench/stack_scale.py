"""1,000 real Python processes watched by their stacks at a 5 s interval, one of them freezing.

A real daemon (``hangwatchd daemon``) and 1,000 real Python interpreters, each registered the
way ``hangwatchd run --stack-timeout`` registers a process with no beats (a registration file,
no beat segment), none of them beating. What they do, as on a node where most processes wait:

- ``idle``: a process blocked in ``select`` on a pipe nobody writes (the idle pattern);
- ``periodic``: a loop that wakes every 2 s, counts and sleeps again (its Python runs between
  two samples, so each of its samples is read again: by the stack probe, and by py-spy where
  the probe finds its frames or locals moved);
- ``busy``: a loop that computes for 5 ms in every 100 ms (read each time, its stack moves);
- one ``freezer``: periodic until the bench asks it to freeze, then blocked on a lock for good.

Measured once the daemon samples them all at the interval's rate (admitting them costs one
py-spy read each, and a window later one native look at each still stack: that time is shown
apart): the daemon's CPU, py-spy's and the probe's included (its children's), over ``--steady``
seconds; the longest gap between two stack samples of any one process (the daemon's
``hangwatchd_stack_sample_gap_seconds`` histogram over those seconds); the freezer's freeze to
``process_hung``. The baseline in the same run: one py-spy dump per sample, the way before
issue 33, timed here on the same processes (its CPU per dump) and scaled to the same number of
samples a second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd.host import procfs  # noqa: E402 - after sys.path is set
from hangwatchd.host.pyspy_binary import find_pyspy  # noqa: E402 - after sys.path is set
from hangwatchd.model import Registration  # noqa: E402 - after sys.path is set
from hangwatchd.testing import ScratchDaemon, wait_for  # noqa: E402 - after sys.path is set
from hangwatchd.workload import registration_file  # noqa: E402 - after sys.path is set

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, Spread, report  # noqa: E402 - after sys.path is set

INTERVAL = 5.0
WINDOW = 20.0
TARGET_GAP = 6.0  # seconds between two samples of one process, at most
TARGET_CPU = 25.0  # per cent of one core, the daemon and its samplers
TARGET_FREEZE = WINDOW + 2.0

WORKLOAD = r"""
import os, select, sys, threading, time
kind, flag = sys.argv[1], sys.argv[2]
print("ready", flush=True)
if kind == "idle":
    r, w = os.pipe()
    select.select([r], [], [])
elif kind == "busy":
    n = 0
    while True:
        end = time.monotonic() + 0.005
        while time.monotonic() < end:
            n += 1
        time.sleep(0.095)
else:
    i = 0
    while kind != "freezer" or not os.path.exists(flag):
        i += 1
        time.sleep(2.0 if kind == "periodic" else 0.5)
    with open(flag + ".at", "w") as f:
        f.write(repr(time.time()))
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()
"""


def spawn(kind: str, flag: Path) -> subprocess.Popen[bytes]:
    # -S: no site packages (nothing here needs them, and 1,000 interpreters start faster).
    return subprocess.Popen([sys.executable, "-S", "-c", WORKLOAD, kind, str(flag)], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def register(runtime: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    staging = runtime / "staging"
    staging.mkdir(exist_ok=True)
    staged = []
    for p in procs:
        me = procfs.identify(p.pid)
        assert me is not None
        staged.append(registration_file.write(staging, Registration(
            process=me, uid=os.getuid(), job=None, beat_file=None, cmdline=("python3", "-c", "..."),
            source="register", registered_at=time.time())))
    for path in staged:
        path.rename(runtime / "registrations" / path.name)


def keep_up(d: ScratchDaemon, n: int, limit: float) -> float:
    """Seconds until the daemon samples ``n`` processes at the interval's rate (over 10 s)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        before = d.metric_total("hangwatchd_stack_samples_total")
        time.sleep(10.0)
        if d.metric_total("hangwatchd_stack_samples_total") - before >= 0.95 * 10.0 * n / INTERVAL:
            return time.monotonic() - start
    raise SystemExit(f"the daemon did not keep up with {n} processes within {limit:g} s")


def cpu_seconds(p: psutil.Process) -> float:
    """The daemon's CPU and its children's: those it reaped (py-spy runs) and those that live on
    (the stack probe's helper)."""
    t = p.cpu_times()
    alive = 0.0
    for child in p.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:
            continue  # ended between the two looks: its CPU is in its parent's reaped children's
        alive += c.user + c.system
    return t.user + t.system + t.children_user + t.children_system + alive


def counts(d: ScratchDaemon) -> tuple[float, float, float]:
    """(py-spy reads, samples carried, carried on the probe's word) so far, from one scrape (at 200
    samples a second, two scrapes a moment apart disagree)."""
    samples = carried = probed = 0.0
    for line in d.scrape().splitlines():
        if line.startswith("hangwatchd_stack_samples_total{"):
            samples += float(line.rsplit(" ", 1)[1])
        elif line.startswith("hangwatchd_stack_samples_carried_total{"):
            carried += float(line.rsplit(" ", 1)[1])
            probed += float(line.rsplit(" ", 1)[1]) if 'why="probe"' in line else 0.0
    return samples - carried, carried, probed


def gap_buckets(d: ScratchDaemon) -> dict[float, float]:
    """hangwatchd_stack_sample_gap_seconds's cumulative buckets: upper bound -> gaps at most that long."""
    out: dict[float, float] = {}
    for line in d.scrape().splitlines():
        if line.startswith("hangwatchd_stack_sample_gap_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = out.get(float(le), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def pyspy_per_dump(pids: list[int], n: int = 40) -> Spread:
    """CPU seconds of one ``py-spy dump --json --nonblocking --locals`` of these processes (the way
    each sample was taken before): the children's CPU, measured in rounds of 10."""
    tool = find_pyspy()
    assert tool is not None
    me = psutil.Process()
    per: list[float] = []
    for r in range(n // 10):
        before = me.cpu_times()
        for k in range(10):
            pid = pids[(r * 10 + k) % len(pids)]
            subprocess.run([tool, "dump", "--json", "--nonblocking", "--locals", "--pid", str(pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        after = me.cpu_times()
        per.append(((after.children_user - before.children_user) + (after.children_system - before.children_system)) / 10)
    return Spread(tuple(per))


def run_once(n: int, steady: float, tmp: Path) -> dict[str, float]:
    periodic, busy = max(1, n * 9 // 100), max(1, n // 100)
    idle = n - periodic - busy - 1
    config = {"max_registrations_per_uid": n + 10, "stack_interval": INTERVAL, "stack_window": WINDOW,
              "discover": False, "rescan_interval": 60.0, "gpu_dump": "never", "startup_grace": 1.0}
    flag = tmp / "freeze"
    d = ScratchDaemon(tmp / "d", config=config)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        kinds = ["idle"] * idle + ["periodic"] * periodic + ["busy"] * busy + ["freezer"]
        for k in kinds:
            procs.append(spawn(k, flag))
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        freezer = procs[-1]
        register(d.runtime_dir, procs)
        wait_for(lambda: (d.metric("hangwatchd_watched_processes", state="healthy") or 0) >= n, 180,
                 f"{n} processes watched", every=1.0)
        # Admitting them costs a py-spy read each, and a window later a native look at each that
        # stood still: measured apart (``settle``), then the steady state once the sampler keeps up.
        t_admit = time.monotonic()
        time.sleep(WINDOW + INTERVAL)
        keep_up(d, n, 600.0)
        time.sleep(INTERVAL)
        settle_s = time.monotonic() - t_admit
        daemon = psutil.Process(d.proc.pid)
        c0, w0 = cpu_seconds(daemon), time.monotonic()
        reads0, carried0, probed0 = counts(d)
        gaps0 = gap_buckets(d)
        time.sleep(steady)
        span = time.monotonic() - w0
        cpu = (cpu_seconds(daemon) - c0) / span * 100
        reads, carried, probed = (b - a for a, b in zip((reads0, carried0, probed0), counts(d)))
        rss = daemon.memory_info().rss / 2**20
        failed = d.metric_total("hangwatchd_stack_samples_total", outcome="failed")
        if os.environ.get("STACK_SCALE_DEBUG"):
            import collections
            print(collections.Counter((e.get("event"), e.get("error", "")[:60]) for e in d.logs()).most_common(12))
        gaps = {le: count - gaps0.get(le, 0.0) for le, count in gap_buckets(d).items()}
        total = gaps.get(float("inf"), 0.0)
        over = total - gaps.get(TARGET_GAP, 0.0)
        # The longest gap, as the histogram knows it: the first bound that holds them all.
        max_gap = min(le for le, count in gaps.items() if count >= total)

        # The freeze: the freezer blocks on a lock for good; declared hung how long after?
        flag.touch()
        wait_for(lambda: Path(str(flag) + ".at").exists(), 10, "the freeze", every=0.1)
        frozen_at = float(Path(str(flag) + ".at").read_text())
        hung = d.event("process_hung", WINDOW + 60, pid=freezer.pid)
        declared = time.time() - frozen_at if "timestamp" not in hung else _wall(hung["timestamp"]) - frozen_at
        per_dump = pyspy_per_dump([p.pid for p in procs[:idle][:20]])
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait()
        d.stop()
    return {"settle": settle_s, "failed": failed, "cpu": cpu, "max_gap": max_gap, "over": over, "gaps": total, "declared": declared, "reads": reads / span,
            "carried": carried / span, "probed": probed / span, "rss": rss, "per_dump": per_dump.median, "idle": idle, "periodic": periodic,
            "busy": busy, "samples_needed": n / INTERVAL}


def _wall(stamp: Any) -> float:
    if isinstance(stamp, (int, float)):
        return float(stamp)
    import datetime
    return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=1000)
    p.add_argument("--steady", type=float, default=30.0, help="seconds measured for CPU and the gaps")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    n = args.processes
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as t:
            r = run_once(n, args.steady, Path(t))
            print(f"stack_scale: run {i + 1}: {r}", flush=True)
            runs.append(r)

    def three(key: str, fmt: str) -> str:
        vals = sorted(r[key] for r in runs)
        return "/".join(format(v, fmt) for v in (vals[0], statistics.median(vals), vals[-1]))

    cpu = [r["cpu"] for r in runs]
    gap = [r["max_gap"] for r in runs]
    dec = [r["declared"] for r in runs]
    per_dump = statistics.median(r["per_dump"] for r in runs)
    needed = runs[0]["samples_needed"]
    before = per_dump * needed * 100
    r0 = runs[0]
    report("stack_scale", [
        Figure(f"{n} processes watched by their stacks (interval {INTERVAL:g} s): the longest gap between two samples "
               "of one process", f"min/median/max of {len(runs)} runs: at most {three('max_gap', 'g')} s "
               f"({sum(r['over'] for r in runs):.0f} of {sum(r['gaps'] for r in runs):.0f} gaps over {TARGET_GAP:g} s; "
               "hangwatchd_stack_sample_gap_seconds's buckets)",
               f"the interval, {INTERVAL:g} s", f"<= {TARGET_GAP:g} s", max(gap) <= TARGET_GAP),
        Figure(f"the daemon, its py-spy runs and its stack probe, {n} processes", f"{three('cpu', '.1f')} % of a core "
               f"(py-spy runs {three('reads', '.1f')}/s, samples carried without one {three('carried', '.0f')}/s, "
               f"{three('probed', '.0f')}/s of them where threads ran but the probe read the same Python state; "
               f"RSS {three('rss', '.0f')} MB)",
               f"one py-spy dump a sample, as before: {per_dump * 1000:.1f} ms of CPU a dump here x {needed:.0f} "
               f"samples/s = {before:.0f} % of a core", f"<= {TARGET_CPU:g} %", max(cpu) <= TARGET_CPU),
        Figure(f"admitting the {n}: one py-spy read each, and a window later one native look at each still stack",
               f"sampled at the interval's rate {three('settle', '.0f')} s after they were registered", "-", "", None),
        Figure("a freeze among them (a thread blocked on a lock for good), to declared hung",
               f"{three('declared', '.1f')} s", f"the window, {WINDOW:g} s", f"<= {TARGET_FREEZE:g} s",
               max(dec) <= TARGET_FREEZE),
    ], note=f"{len(runs)} runs; {r0['idle']:.0f} processes blocked in select, {r0['periodic']:.0f} waking every 2 s, "
            f"{r0['busy']:.0f} computing 5 ms in 100, 1 freezing, each a real `python3 -S`, registered with no beats "
            f"(watched by its stack, window {WINDOW:g} s); the CPU is the daemon's and its children's (py-spy, the probe) "
            "over 30 s once it keeps up; this 2-core machine, shared with other work while measured",
       command=f"python bench/stack_scale.py --processes {n} --runs {len(runs)}")


if __name__ == "__main__":
    main()
