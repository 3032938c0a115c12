"""GPU scenarios, each driving the real daemon end to end on a GPU machine (never in CI).

    PYTHONPATH=. python3 tests/gpu/run_scenarios.py OUTDIR

1. triton_hang: a Triton kernel spins; the heartbeat stops; the native stack shows
   cuStreamSynchronize, which confirms the hang, so the daemon takes a CUDA dump.
2. cpp_ima: a C++ kernel hits an illegal address three inlined calls deep; the
   driver's exception dump becomes an incident by itself.
3. graph_ima: a fill kernel faults during a CUDA graph replay.
4. cpp_hang: a C++ kernel spins on a flag; not Python, no beat: captured by hand
   with `hangwatchd capture PID --gpu-dump`.

Each must end in one incident naming the kernel (and the source line where the
cubin has line info). Prints a summary and writes OUTDIR/summary.json.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, stop, wait_for  # noqa: E402

FIX = ROOT / "tests" / "fixtures" / "gpu"


def ts(e: dict) -> float:
    return datetime.datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()


def show(d: ScratchDaemon, inc: dict, out: Path, name: str) -> str:
    res = subprocess.run(hangwatchd_argv("show", inc["id"], "--state-dir", str(d.state_dir)), capture_output=True, text=True)
    (out / f"{name}-show.txt").write_text(res.stdout + res.stderr)
    return res.stdout


def symbolized(inc: dict) -> dict:
    for p in Path(inc["dir"]).glob("*/symbolized.json"):
        return json.loads(p.read_text())
    return {}


def new_incident(d: ScratchDaemon, seen: set[str], seconds: float) -> dict:
    def fresh():
        return [i for i in d.settled() if i["id"] not in seen]
    inc = wait_for(fresh, seconds, "an incident", every=0.2)[0]
    seen.add(inc["id"])
    return inc




def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    base = Path("/tmp/hangwatchd-gpu")
    shutil.rmtree(base, ignore_errors=True)
    results = {}
    seen: set[str] = set()
    started: list[subprocess.Popen[bytes]] = []  # every workload, stopped at the end whatever happened
    d = ScratchDaemon(base, config={"gpu_dump": "confirmed", "pyspy_timeout": 20.0})
    try:
        # 1. triton_hang
        work = d.run([sys.executable, str(ROOT / "tests/gpu/triton_hang.py")], "--heartbeat-timeout", "5",
                     "--job", "triton", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        started.append(work)
        line = work.stdout.readline().decode()
        stall = float(line.split()[1])
        inc = new_incident(d, seen, 120)
        stored = ts(d.event("incident_stored", 30, incident=inc["id"]))
        sym = symbolized(inc)
        steps = json.loads((Path(inc["dir"]) / "incident.json").read_text())["processes"][0]["steps"]
        results["triton_hang"] = {
            "reason": inc["reason"], "seconds_stall_to_incident": round(stored - stall, 2),
            "steps": {s["step"]: ("skipped" if s.get("skipped") else "ok" if s["ok"] else "FAILED: " + str(s["error"]))
                      + f" ({s['seconds']:.2f} s)" for s in steps},
            "kernels": [k["name"] for k in sym.get("kernels", [])],
            "pcs": [[(f["function"], f["line"]) for f in p["frames"]] for p in sym.get("pcs", [])],
        }
        show(d, inc, out, "triton_hang")
        try:
            results["triton_hang"]["workload_exit"] = work.wait(30)
        except subprocess.TimeoutExpired:
            results["triton_hang"]["workload_exit"] = "still running: killed"
            stop(work, sig=signal.SIGKILL)

        # 2. cpp_ima and 4. cpp_hang need the C++ program
        binary = base / "inlined"
        subprocess.run(["nvcc", "-lineinfo", "-arch=sm_90", "-o", str(binary), str(FIX / "cpp_ima" / "inlined.cu")], check=True)
        start = time.time()
        work = d.run([str(binary)], "--job", "cpp_ima", stderr=subprocess.PIPE)
        started.append(work)
        _, err = work.communicate(timeout=120)
        inc = new_incident(d, seen, 120)
        stored = ts(d.event("incident_stored", 30, incident=inc["id"]))
        sym = symbolized(inc)
        results["cpp_ima"] = {
            "reason": inc["reason"], "summary": inc["summary"], "exit": work.returncode,
            "seconds_start_to_incident": round(stored - start, 2),
            "exceptions": [(e["type"], e["kernel"], [(f["function"], f["line"]) for f in e["frames"]]) for e in sym.get("exceptions", [])],
        }
        show(d, inc, out, "cpp_ima")

        # 3. graph_ima
        start = time.time()
        work = d.run([sys.executable, str(FIX / "graph_ima" / "graph_ima.py")], "--job", "graph_ima", stderr=subprocess.PIPE)
        started.append(work)
        _, err = work.communicate(timeout=120)
        inc = new_incident(d, seen, 120)
        stored = ts(d.event("incident_stored", 30, incident=inc["id"]))
        results["graph_ima"] = {"reason": inc["reason"], "summary": inc["summary"], "exit": work.returncode,
                                "seconds_start_to_incident": round(stored - start, 2)}
        show(d, inc, out, "graph_ima")

        # 4. cpp_hang, by hand
        env = dict(os.environ, CUDA_ENABLE_USER_TRIGGERED_COREDUMP="1", CUDA_COREDUMP_SHOW_PROGRESS="1",
                   CUDA_COREDUMP_PIPE=str(base / "run" / "pipes" / "cuda_pipe.%p"),
                   CUDA_COREDUMP_FILE=str(base / "manual-dumps" / "core_%h.%p.%t.nvcudmp"),
                   CUDA_COREDUMP_GENERATION_FLAGS="skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory,skip_constbank_memory")
        (base / "manual-dumps").mkdir()
        hang = subprocess.Popen([str(binary), "h"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        started.append(hang)
        hang.stdout.readline()
        time.sleep(2)
        start = time.time()
        cap = subprocess.run(hangwatchd_argv("capture", str(hang.pid), "--gpu-dump", "--state-dir", str(base / "manual")),
                             capture_output=True, text=True, timeout=300)
        (out / "cpp_hang-show.txt").write_text(cap.stdout + cap.stderr)
        from hangwatchd.incidents.store import Store

        (inc,) = Store(base / "manual").list()
        sym = symbolized(inc)
        results["cpp_hang"] = {
            "exit": cap.returncode, "seconds_capture": round(time.time() - start, 2),
            "kernels": [(k["name"], k["sms"]) for k in sym.get("kernels", [])],
            "pcs": [[(f["function"], f["line"]) for f in p["frames"]] for p in sym.get("pcs", [])],
        }
        stop(hang, sig=signal.SIGKILL)
    except Exception as exc:  # record how far it got; the summary says what failed
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop(*started, sig=signal.SIGKILL)  # by pid: `hangwatchd run` takes its workload with it
        d.stop()
        shutil.copy(d.log, out / "daemon.log")
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu-out")))
