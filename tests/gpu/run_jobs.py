"""Ranks that are gone, on a 2-GPU machine, through the real daemon; keeps the incidents.

    PYTHONPATH=. python3 tests/gpu/run_jobs.py OUTDIR [--scenario uneven|killed|both] [--fake]
                                               [--hold SECONDS] [--on-hang abort|report]

Each rank is started by its own `hangwatchd run` (no torchrun, so the survivor stays):
(i)  uneven: rank 1's data is shorter: it exits 0 after all_reduce #STEPS, rank 0 waits in #STEPS+1;
(ii) killed: rank 1 is SIGKILLed from outside while rank 0 trains on, and then waits in all_reduce.
The incident's verdict must lead with rank 1. Prints, and writes under OUTDIR/SCENARIO/, the
verdict summary, the culprits and the timings (rank 1's end, rank 0's last beat, hang declared,
incident stored). --hold keeps the hang going that long after the incident and counts the
daemon's `process_hung` and `incident_stored` events (one hang must be one incident); --on-hang
abort has the daemon end the job once its incident is stored, and times that. --fake runs the same without torch or a GPU (a barrier of files stands in
for all_reduce), to check this script on a CPU machine.

Every wait has a deadline, the whole run has one (SIGALRM), and every process it started is
killed with its process group at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, stop, wait_for  # noqa: E402

STEPS = 25
HEARTBEAT_TIMEOUT = 10
WHOLE_RUN = 540  # seconds, both scenarios: under the device tool's 600 s a command


def ts(e: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(d: ScratchDaemon) -> list[dict[str, Any]]:
    res = subprocess.run(hangwatchd_argv("status", "--json", "--runtime-dir", str(d.runtime_dir)),
                         capture_output=True, text=True, timeout=30)
    return json.loads(res.stdout)["processes"] if res.returncode == 0 else []




def scenario(name: str, out: Path, fake: bool, hold: float = 0.0, on_hang: str | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix=f"hangwatchd-jobs-{name}-"))
    fake_dir = base / "barrier"
    fake_dir.mkdir()
    d = ScratchDaemon(base, config={"gpu_dump": "confirmed", "pyspy_timeout": 20.0, "flight_recorder_timeout": 30.0})
    port = free_port()
    ranks: list[subprocess.Popen[bytes]] = []
    logs = []
    result: dict[str, Any] = {"scenario": name, "fake": fake}
    t0 = time.time()
    try:
        for r in (0, 1):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), JOBS_FAKE_DIR=str(fake_dir),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
            log = open(out / f"rank{r}.log", "wb")
            logs.append(log)
            argv = [sys.executable, str(ROOT / "tests/gpu/jobs_rank.py"), "--scenario", name, "--steps", str(STEPS)]
            policy = ["--on-hang", on_hang] if on_hang else []
            ranks.append(d.run(argv + (["--fake"] if fake else []), "--job", f"jobs-{name}", "--heartbeat-timeout",
                               str(HEARTBEAT_TIMEOUT), *policy, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True))
        def registered() -> Any:
            dead = [r for r, p in enumerate(ranks) if p.poll() is not None]
            if dead:  # a rank that died at start: say so now, not after the deadline
                raise RuntimeError(f"rank {dead[0]} exited with {ranks[dead[0]].returncode} before registering: see rank{dead[0]}.log")
            p = status(d)
            return p if {x["rank"] for x in p} >= {0, 1} else None

        procs = wait_for(registered, 120,
                         "both ranks registered", every=0.5)
        pid = {p["rank"]: p["pid"] for p in procs}
        result["pids"] = pid
        if name == "killed":
            wait_for(lambda: all(p["beats"] >= 20 for p in status(d) if p["rank"] in (0, 1)), 120, "20 beats each", every=0.5)
            result["killed_at"] = time.time()
            os.kill(pid[1], signal.SIGKILL)  # the OOM killer, a failing node: from outside
        result["rank1_returncode"] = ranks[1].wait(120)
        inc = wait_for(d.settled, 180, "the incident", every=0.5)[0]
        result["incident"] = inc["id"]
        meta = json.loads((Path(inc["dir"]) / "incident.json").read_text())
        res = subprocess.run(hangwatchd_argv("analyze", inc["dir"], "--json"), capture_output=True, text=True, timeout=120)
        (out / "analysis.json").write_text(res.stdout + res.stderr)
        analysis = json.loads(res.stdout) if res.returncode == 0 else meta.get("analysis") or {}
        show = subprocess.run(hangwatchd_argv("show", inc["id"], "--state-dir", str(d.state_dir)),
                              capture_output=True, text=True, timeout=60)
        (out / "show.txt").write_text(show.stdout + show.stderr)
        exit_files = {p.parent.name: json.loads(p.read_text()) for p in Path(inc["dir"]).glob("*/exit.json")}
        if on_hang == "abort":
            ended = wait_for(lambda: ranks[0].poll() is not None and time.time(), 60, "rank 0 ended by the daemon", every=0.1)
            result["rank0_run_returncode"] = ranks[0].returncode
            result["rank0_ended_at"] = ended
        if hold:
            time.sleep(hold)  # the hang goes on: count what the daemon makes of it meanwhile
        events = d.logs()
        result["process_hung_events"] = sum(1 for e in events if e.get("event") == "process_hung")
        result["incidents_stored"] = sum(1 for e in events if e.get("event") == "incident_stored")
        result["held_s"] = hold
        hung = next((e for e in events if e.get("event") == "process_hung" and e.get("pid") == pid[0]), None)
        stored = next((e for e in events if e.get("event") == "incident_stored"), None)
        ex = exit_files.get(str(pid[1]), {})
        since = meta.get("since")
        result.update({
            "summary": analysis.get("summary"),
            "culprits": analysis.get("culprits"),
            "ranks": [(v.get("rank"), v.get("verdict"), v.get("detail")) for v in analysis.get("ranks", [])],
            "rank1_exit": {k: ex.get(k) for k in ("status", "signal", "signal_name", "how", "time", "last_beat_time", "beats")},
            "first_culprit_is_rank1": bool(analysis.get("culprits")) and analysis["culprits"][0].get("rank") == 1,
            "summary_leads_with_rank1": str(analysis.get("summary", "")).startswith("Rank 1 "),
            "timings_s": {
                "rank1_end_after_start": round(ex["time"] - t0, 2) if ex.get("time") else None,
                "rank0_last_beat_after_rank1_end": round(since - ex["time"], 2) if since and ex.get("time") else None,
                "hung_after_rank0_last_beat": round(ts(hung) - since, 2) if hung and since else None,
                "stored_after_rank0_last_beat": round(ts(stored) - since, 2) if stored and since else None,
                "capture_seconds": stored.get("seconds") if stored else None,
                "rank0_ended_after_last_beat": round(result["rank0_ended_at"] - since, 2)
                if result.get("rank0_ended_at") and since else None,
            },
            "steps": {p.get("pid"): {s["step"]: ("ok" if s["ok"] else "skipped" if s.get("skipped") else "FAILED")
                                     for s in p.get("steps", [])} for p in meta.get("processes", [])},
        })
        with tarfile.open(out / "incident.tar.xz", "w:xz") as tar:  # small: the raw GPU dumps stay behind
            tar.add(inc["dir"], arcname=f"{name}-incident", filter=lambda t: None if t.name.endswith(".zst") else t)
    except Exception as exc:  # noqa: BLE001 - report what happened, then clean up; the other scenario still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in ranks:
            stop(p, sig=signal.SIGKILL, group=True)
        for log in logs:
            log.close()
        d.stop()
        shutil.copy(d.log, out / "daemon.log")
        shutil.rmtree(base, ignore_errors=True)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("outdir", type=Path)
    p.add_argument("--scenario", choices=["uneven", "killed", "both"], default="both")
    p.add_argument("--fake", action="store_true", help="no torch, no GPU: check the runner itself")
    p.add_argument("--hold", type=float, default=0.0, help="seconds to keep the hang going after the incident")
    p.add_argument("--on-hang", choices=["abort", "report"], default=None)
    a = p.parse_args()

    def too_long(*_: object) -> None:
        raise TimeoutError(f"run_jobs.py: past its {WHOLE_RUN} s deadline")

    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(WHOLE_RUN)
    names = ["uneven", "killed"] if a.scenario == "both" else [a.scenario]
    results = [scenario(n, a.outdir / n, a.fake, a.hold, a.on_hang) for n in names]
    signal.alarm(0)
    for r in results:
        print(f"== {r['scenario']}{' (fake)' if r['fake'] else ''}")
        print(json.dumps({k: r.get(k) for k in ("error", "summary", "culprits", "rank1_exit", "first_culprit_is_rank1",
                                                   "summary_leads_with_rank1", "timings_s", "steps", "held_s",
                                                   "process_hung_events", "incidents_stored", "rank0_run_returncode")
                          if k in r},
                         indent=1, default=str)[:4000])
    ok = all(r.get("first_culprit_is_rank1") and r.get("summary_leads_with_rank1") for r in results)
    once = all(r.get("incidents_stored") == 1 for r in results)
    print("ok" if ok else "FAILED: the verdict does not lead with rank 1")
    print("one incident per hang" if once else "FAILED: not exactly one incident per hang")
    ok = ok and once
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
