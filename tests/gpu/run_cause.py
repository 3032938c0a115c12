"""The cause elsewhere on the node, through the real daemon on one GPU (never in CI).

    PYTHONPATH=. python3 tests/gpu/run_cause.py OUTDIR

1. dataloader: a DataLoader worker blocks for ever reading a FIFO; the training loop's beats stop.
   Expect child-stuck: "DataLoader worker 1 (pid N) is stuck in read_shard (cause_dataloader.py:19),
   reading FIFO .../shard-0042; the training loop waits for it in _next_data (cause_dataloader.py:38)".
2. server: threads cache and stats deadlock on two locks (tests/cause/server.py), the main thread joins.
   Expect thread-deadlock: "deadlock between threads cache (update_cache, server.py:14) and stats
   (report_stats, server.py:21)".
3. shared-nvml: the stream deadlock of tests/gpu/stream_deadlock.py on GPU 0 while another process
   keeps GPU 0 busy; no GPU dump. Expect stream-deadlock from NVML's per-process samples:
   "... this process running nothing on GPU 0; GPU 0 is shared, N% busy with other processes (PID)".
4. shared-dump: the same with the GPU dump (gpu_dump = "confirmed"). Expect stream-deadlock:
   "the GPU dump shows no kernel running on GPU 0" (if the dump lists the queued kernels as running,
   this prints what it read instead).

Prints one line per scenario, "NAME: VERDICT-KIND: SUMMARY", and writes OUTDIR/NAME-analysis.json and
OUTDIR/summary.json; exits 0 when every scenario got the verdict kind it expects.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, stop, wait_for  # noqa: E402

GPU = ROOT / "tests" / "gpu"
CAUSE = ROOT / "tests" / "cause"


def one(name: str, out: Path, command: list[str], options: list[str], config: dict, expect: str,
        neighbour: bool = False) -> dict:
    base = Path(f"/tmp/hangwatchd-cause-{name}")
    shutil.rmtree(base, ignore_errors=True)
    busy = None
    if neighbour:
        busy = subprocess.Popen([sys.executable, str(GPU / "cause_busy_neighbour.py")], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        assert busy.stdout is not None
        assert busy.stdout.readline().startswith("BUSY"), "the busy neighbour did not start"
    d = ScratchDaemon(base / "d", config={"pyspy_timeout": 20.0, **config})
    work = None
    try:
        env = dict(os.environ, PYTHONPATH=f"{CAUSE}{os.pathsep}{ROOT}")
        work = d.run(command, *options, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        assert work.stdout is not None
        line = work.stdout.readline()
        started = time.time()
        inc = wait_for(d.store().list, 240, f"{name}: the incident", every=0.5)[0]
        res = subprocess.run(hangwatchd_argv("analyze", inc["dir"], "--json"), capture_output=True, text=True)
        (out / f"{name}-analysis.json").write_text(res.stdout + res.stderr)
        show = subprocess.run(hangwatchd_argv("show", inc["id"], "--state-dir", str(d.state_dir)), capture_output=True, text=True)
        (out / f"{name}-show.txt").write_text(show.stdout + show.stderr)
        analysis = json.loads(res.stdout) if res.returncode == 0 else {}
        kind = (analysis.get("ranks") or [{}])[0].get("verdict")
        row = {"name": name, "expect": expect, "verdict": kind, "summary": analysis.get("summary"),
               "children": [(c.get("role"), c.get("pid"), c.get("verdict")) for c in analysis.get("children") or []],
               "ready_line": line.strip(), "stall_to_listed_s": round(time.time() - started, 1)}
        print(f"{name}: {kind}: {row['summary']}", flush=True)
        return row
    finally:
        if work is not None:
            stop(work, group=True, grace=5)
        if busy is not None:
            stop(busy, group=True, grace=5)
        d.stop()
        shutil.copy(d.log, out / f"{name}-daemon.log")


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    scenarios = [
        ("dataloader", out, [sys.executable, str(GPU / "cause_dataloader.py"), "/tmp/hangwatchd-cause-shards"],
            ["--heartbeat-timeout", "5", "--job", "dataloader"], {"gpu_dump": "never"}, "child-stuck", {}),
        ("server", out, [sys.executable, str(CAUSE / "server.py")], ["--stack-timeout", "3", "--heartbeat-timeout", "3600"],
            {"gpu_dump": "never"}, "thread-deadlock", {}),
        ("shared-nvml", out, [sys.executable, str(GPU / "stream_deadlock.py")], ["--heartbeat-timeout", "5", "--job", "stream"],
            {"gpu_dump": "never"}, "stream-deadlock", {"neighbour": True}),
        ("shared-dump", out, [sys.executable, str(GPU / "stream_deadlock.py")], ["--heartbeat-timeout", "5", "--job", "stream"],
            {"gpu_dump": "confirmed"}, "stream-deadlock", {"neighbour": True}),
    ]
    rows = []
    for name, *args in scenarios:
        kw = args.pop()
        try:
            rows.append(one(name, *args, **kw))  # args start with OUTDIR
        except Exception as exc:  # noqa: BLE001 - one scenario's failure must not hide the others'
            print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
            rows.append({"name": name, "expect": args[4], "verdict": None, "error": f"{type(exc).__name__}: {exc}"})
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    bad = [r["name"] for r in rows if r["verdict"] != r["expect"]]
    print("all scenarios gave the verdict they expect" if not bad else f"unexpected verdicts: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/hangwatchd-cause-out")))
