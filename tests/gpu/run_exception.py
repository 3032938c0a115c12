"""GPU exceptions caught alive through the daemon's FIFO, on a real GPU (never in CI): run as root on a
GPU machine with torch.

    PYTHONPATH=. python3 tests/gpu/run_exception.py OUTDIR

Under one daemon, one after the other, each through ``hangwatchd run``:

- ``eager``: the illegal index of tests/fixtures/gpu/torch_ima (``print(data[index])``, line 26);
- ``graph``: the out-of-bounds fill in a CUDA graph's replay of tests/fixtures/gpu/graph_ima
  (``g.replay()``, line 32; the error surfaces at ``out.sum().item()``, line 33).

(A Triton kernel's fault in a thread of the program's own is the catalogue's
gpu_model_thread_died_on_cuda_error, run beside this by tests/gpu/run_device.sh exception.)

For each: the incident (reason, verdict, each step's outcome and seconds), when the daemon saw the
first bytes, took the stacks and filed it (its log), the surfacing thread's frames as py-spy saw
them, the dump's size, the process's exit status and its stderr's driver lines. Writes
OUTDIR/exception.json and prints it; exits 0 when the eager case's verdict names the kernel and
``print(data[index])``, and the graph case's names the replay, ``g.replay()`` (graph_ima.py:32).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, stop, wait_for  # noqa: E402


def case(d: ScratchDaemon, name: str, argv: list[str], out: Path) -> dict[str, Any]:
    started = time.time()
    work = d.run(argv, "--job", name, "--heartbeat-timeout", "30", stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    result: dict[str, Any] = {"case": name}
    try:
        _, err = work.communicate(timeout=120)
        result["exit"] = work.returncode
        result["driver_lines"] = [ln for ln in err.decode("utf-8", "replace").splitlines()
                                  if "coredump:" in ln or "Error" in ln or ln.startswith("  File")][:40]
        found = wait_for(lambda: [i for i in d.store().list() if i["job"] == name and not i.get("pending")] or None, 90,
                         f"{name}'s incident")
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        result["error"] = str(exc)
        return result
    finally:
        stop(work)
    inc = found[0]
    data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
    result.update(reason=data["reason"], verdict=data.get("verdict"), detail=data.get("detail"), incidents=len(found),
                  steps=[{k: s.get(k) for k in ("step", "ok", "seconds", "error", "files")} for p in data["processes"]
                         for s in p["steps"]])
    pid = data["processes"][0]["pid"]
    pdir = Path(inc["dir"]) / str(pid)
    events = {e["event"]: e for e in d.logs() if e.get("pid") == pid or e.get("incident") == inc["id"]}
    result["log"] = {k: events[k].get("timestamp") for k in ("exception_begun", "exception_looked", "incident_stored")
                     if k in events}
    result["seconds_from_start"] = round(float(inc["time"]) - started, 2)
    for name_, f in (("native", "pyspy-native.json"), ("plain", "pyspy.json")):
        if (pdir / f).exists():
            stacks = json.loads((pdir / f).read_text())
            result[f"threads_{name_}"] = [{"name": t.get("thread_name"), "frames": [
                f"{fr.get('name')} ({Path(str(fr.get('filename'))).name}:{fr.get('line')})" for fr in t["frames"][:40]]}
                for t in stacks][:12]
    for f in ("code.json", "symbolized.json"):
        if (pdir / f).exists():
            loaded = json.loads((pdir / f).read_text())
            result[f] = loaded if f == "code.json" else {"exceptions": loaded.get("exceptions"), "size": loaded.get("size"),
                                                          "kernels": [k.get("name", "")[:200] for k in loaded.get("kernels") or []]}
    result["files"] = sorted(p.name + f" {p.stat().st_size}" for p in pdir.iterdir())
    (out / name).mkdir(exist_ok=True)
    for f in pdir.iterdir():
        if f.suffix in (".json", ".txt", ".log"):
            (out / name / f.name).write_bytes(f.read_bytes())
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("outdir", type=Path)
    a = p.parse_args()
    a.outdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, lambda *_: sys.exit("run_exception: over its 95 s deadline"))
    signal.alarm(95)
    base = Path("/tmp/hangwatchd-exception")
    subprocess.run(["rm", "-rf", str(base)], check=False)
    fixtures = ROOT / "tests" / "fixtures" / "gpu"
    results = []
    d = ScratchDaemon(base / "d", config={"gpu_dump": "never"})
    try:
        for name, argv in (("eager", [sys.executable, str(fixtures / "torch_ima" / "illegal_memory_access.py")]),
                           ("graph", [sys.executable, str(fixtures / "graph_ima" / "graph_ima.py")])):
            results.append(case(d, name, argv, a.outdir))
            print(json.dumps({k: results[-1].get(k) for k in ("case", "exit", "reason", "verdict", "log")}), flush=True)
    finally:
        d.stop()
        (a.outdir / "daemon.log").write_bytes(d.log.read_bytes()[-4_000_000:])
    (a.outdir / "exception.json").write_text(json.dumps(results, indent=1))
    eager, graph = str(results[0].get("verdict")), str(results[-1].get("verdict"))
    ok = "index_elementwise_kernel" in eager and "print(data[index])" in eager and "`g.replay()` (graph_ima.py:32)" in graph
    print(json.dumps(results, indent=1)[:20000])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
