"""Many hangs at once: 50 processes of 50 different jobs, then 50 ranks of one job, hanging together.

A real daemon (``hangwatchd daemon``, GPU dump off: there is no GPU here) and real processes,
each started by ``hangwatchd run --job JOB --heartbeat-timeout 5`` (its child is registered
and beats through ``hangwatchd.beat()``, as a training loop's would). They beat every 0.1 s
until the bench tells them all to stop, at one moment; each then prints the time of its last
beat and blocks for good. What is measured: for each process, the time from its last beat to
the loop's ``incident_stored`` naming it (the log line's timestamp), the last of them being the
figure. The baseline in the same run, under the same daemon: one process of a job of its own,
hanging alone. ``--runs`` repeats the whole (min/median/max shown).
"""

from __future__ import annotations

import argparse
import datetime
import json
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

from hangwatchd.testing import ScratchDaemon, stop, wait_for  # noqa: E402 - after sys.path is set

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, report  # noqa: E402 - after sys.path is set

TIMEOUT = 5.0  # each process's declared heartbeat timeout
TARGET = TIMEOUT + 5.0  # every one of them stored within this of its last beat

# Beats every 0.1 s until the flag file exists, then prints the time of its last beat and blocks for good.
WORKLOAD = r"""
import os, sys, threading, time
import hangwatchd
flag = sys.argv[1]
hangwatchd.beat()
print("ready", flush=True)
while not os.path.exists(flag):
    hangwatchd.beat()
    time.sleep(0.1)
hangwatchd.beat()
print(repr(time.time()), flush=True)
threading.Event().wait()
"""


def _wall(stamp: Any) -> float:
    return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def stored_at(d: ScratchDaemon) -> dict[int, tuple[float, float]]:
    """pid -> (when the loop logged its incident stored, the capture's own seconds) from the daemon's log."""
    out: dict[int, tuple[float, float]] = {}
    for e in d.logs():
        if e.get("event") == "incident_stored" and "pids" in e:
            for pid in e["pids"]:
                out.setdefault(int(pid), (_wall(e["timestamp"]), float(e.get("seconds", 0.0))))
    return out


class Hangers:
    """``n`` processes under ``hangwatchd run``, each of the job ``job_of(k)``, beating until told to stop."""

    def __init__(self, d: ScratchDaemon, flag: Path, jobs: list[str], ranks: bool) -> None:
        self.flag = flag
        self.procs = [d.run([sys.executable, "-c", WORKLOAD, str(flag)], "--job", job,
                            *(["--rank", str(k)] if ranks else []), "--heartbeat-timeout", f"{TIMEOUT:g}",
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
                      for k, job in enumerate(jobs)]
        for p in self.procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != b"ready":
                raise SystemExit(f"a workload under `hangwatchd run` did not start (exit {p.poll()})")

    def hang(self) -> dict[int, float]:
        """Tell them all to stop beating; each one's child pid -> the time of its last beat."""
        self.flag.touch()
        last = {}
        for p in self.procs:
            assert p.stdout is not None
            at = float(p.stdout.readline())
            last[_child_of(p.pid)] = at
        return last

    def stop(self) -> None:
        stop(*self.procs, group=True, grace=5.0)


def _child_of(pid: int) -> int:
    """The workload's pid: the only child of its ``hangwatchd run``."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(kids) != 1:
        raise SystemExit(f"`hangwatchd run` (pid {pid}) has {len(kids)} children, not one")
    return int(kids[0])


def watched_healthy(d: ScratchDaemon) -> float:
    return d.metric("hangwatchd_watched_processes", state="healthy") or 0.0


def cpu_seconds(p: psutil.Process) -> float:
    """The daemon's CPU time and its reaped children's (py-spy, probes)."""
    t = p.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def hang_together(d: ScratchDaemon, tmp: Path, name: str, jobs: list[str], ranks: bool) -> tuple[list[float], float, float]:
    """Every process's seconds from its last beat to its incident stored, the slowest capture's own
    seconds, and the daemon's CPU seconds (its children's included) from the hang to the last stored."""
    before = watched_healthy(d)
    daemon = psutil.Process(d.proc.pid)
    group = Hangers(d, tmp / f"{name}.flag", jobs, ranks)
    try:
        wait_for(lambda: watched_healthy(d) >= before + len(jobs), 120, f"{len(jobs)} processes watched", every=0.5)
        time.sleep(2.0)  # past the admissions' tail
        cpu0 = cpu_seconds(daemon)
        last = group.hang()
        wait_for(lambda: set(last) <= set(stored_at(d)), 180, f"{len(jobs)} incidents stored", every=0.5)
        cpu = cpu_seconds(daemon) - cpu0
        got = stored_at(d)
    finally:
        group.stop()
    return sorted(got[pid][0] - at for pid, at in last.items()), max(got[pid][1] for pid in last), cpu


def run_once(n: int, tmp: Path) -> dict[str, Any]:
    config = {"gpu_dump": "never", "discover": False, **json.loads(os.environ.get("MANY_HANGS_CONFIG", "{}"))}
    with ScratchDaemon(tmp / "d", config=config) as d:
        alone, alone_capture, alone_cpu = hang_together(d, tmp, "alone", ["alone"], False)
        many, many_capture, many_cpu = hang_together(d, tmp, "many", [f"job{k}" for k in range(n)], False)
        ranks, ranks_capture, ranks_cpu = hang_together(d, tmp, "ranks", ["one"] * n, True)
        if os.environ.get("MANY_HANGS_DEBUG"):
            (Path(os.environ["MANY_HANGS_DEBUG"]) / "daemon.log").write_text(d.log.read_text())
    return {"alone": alone[0], "alone_capture": alone_capture, "alone_cpu": alone_cpu, "many": many,
            "many_capture": many_capture, "many_cpu": many_cpu, "ranks": ranks, "ranks_capture": ranks_capture,
            "ranks_cpu": ranks_cpu}


def three(values: list[float]) -> str:
    v = sorted(values)
    return f"{v[0]:.1f}/{statistics.median(v):.1f}/{v[-1]:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=50)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    n = args.processes
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as t:
            r = run_once(n, Path(t))
        print(f"many_hangs: run {i + 1}: " + json.dumps({k: (round(v, 2) if isinstance(v, float) else
                                                           [round(x, 2) for x in v]) for k, v in r.items()}), flush=True)
        runs.append(r)
    alone = [r["alone"] for r in runs]
    figures = []
    for key, what in (("many", f"{n} processes of {n} different jobs hanging at once"),
                      ("ranks", f"{n} ranks of one job hanging at once")):
        last = [max(r[key]) for r in runs]
        first = [min(r[key]) for r in runs]
        figures.append(Figure(
            f"{what} (timeout {TIMEOUT:g} s): last beat to incident stored, the last of them",
            f"min/median/max of {len(runs)} runs: {three(last)} s (the first of them: {three(first)} s; the slowest "
            f"capture {three([r[key + '_capture'] for r in runs])} s from its declaration)",
            f"one process hanging alone, same daemon: {three(alone)} s (capture {three([r['alone_capture'] for r in runs])} s)",
            f"<= {TARGET:g} s (timeout + 5 s)", max(last) <= TARGET))
    report("many_hangs", figures,
           note=f"{len(runs)} runs; real `python3` processes each under `hangwatchd run --job ... --heartbeat-timeout "
                f"{TIMEOUT:g}`, beating every 0.1 s through `hangwatchd.beat()` until told to stop, all at one moment; "
                "the daemon as root (no per-user capture budget), GPU dump off (no GPU); "
                "this 2-core machine, shared with other work while measured",
           command=f"python bench/many_hangs.py --processes {n} --runs {len(runs)}")


if __name__ == "__main__":
    main()
