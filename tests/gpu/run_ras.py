"""hangwatchd's RAS client against a real NCCL job on a 2-GPU machine (never in CI).

    PYTHONPATH=. python3 tests/gpu/run_ras.py OUTDIR

Two ranks, each on its own GPU, started by hand (no torchrun, so the survivor
stays), ten all_reduces; then rank 1 sleeps on the host while rank 0 enters an
eleventh. Asked through hangwatchd's own client (capture/nccl_ras.ask): the
answer must read as a MISMATCH naming rank 1 behind; after rank 1 is SIGKILLed,
as rank 1 missing, and the verdict on rank 0's incident directory must blame
rank 1 (pid, node, GPU). Prints and writes OUTDIR/summary.json; exit 0 when all hold.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.analyze import ras  # noqa: E402
from hangwatchd.analyze.verdict import analyze  # noqa: E402
from hangwatchd.capture.nccl_ras import ask  # noqa: E402
from hangwatchd.workload.launcher import free_local_port  # noqa: E402

RANK = """
import os, time, torch, torch.distributed as dist
r = int(os.environ["RANK"]); torch.cuda.set_device(r)
dist.init_process_group("nccl", device_id=torch.device("cuda", r))
x = torch.ones(1024, device="cuda")
for _ in range(10): dist.all_reduce(x)
torch.cuda.synchronize()
print("ready", flush=True)
if r == 1: time.sleep(3600)
dist.all_reduce(x); torch.cuda.synchronize(); time.sleep(3600)
"""


def keep(out: Path, name: str, answer) -> dict:  # type: ignore[no-untyped-def]
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    if answer.text is not None:
        (d / "nccl-ras.txt").write_bytes(answer.text)
    if answer.json:
        (d / "nccl-ras.json").write_bytes(answer.json)
    view, problems = ras.read(d)
    return {"seconds": round(answer.seconds, 4), "error": answer.error, "problems": list(problems),
            "missing": [(r.rank, r.pid, r.node, r.gpu, r.state) for r in (view.missing if view else ())],
            "behind": [(m.collective, [(c.rank, c.count) for c in m.behind], m.ahead) for m in (view.mismatches if view else ())]}


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    addr = f"127.0.0.1:{free_local_port()}"
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()), WORLD_SIZE="2", NCCL_RAS_ADDR=addr)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK], env=dict(base, RANK=str(r)), stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    summary: dict = {"ras_addr": addr, "pids": [p.pid for p in ranks]}
    try:
        for p in ranks:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(5)
        summary["diverged"] = keep(out, "diverged", ask(addr, 5.0))
        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].wait()
        time.sleep(6)
        summary["killed-6s"] = keep(out, "killed-6s", ask(addr, 5.0))
        inc = out / "incident" / str(ranks[0].pid)
        inc.mkdir(parents=True, exist_ok=True)
        (inc / "proc.json").write_text(json.dumps({"pid": ranks[0].pid, "rank": 0, "world_size": 2}))
        for f in (out / "killed-6s").iterdir():
            (inc / f.name).write_bytes(f.read_bytes())
        a = analyze(out / "incident").to_dict()
        summary["verdict"] = {"summary": a["summary"], "culprits": a["culprits"], "unreadable": a["unreadable"]}
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    ok = (summary["diverged"]["behind"] and summary["diverged"]["behind"][0][1] == [(1, 10)]
          and any(m[0] == 1 and m[1] == summary["pids"][1] for m in summary["killed-6s"]["missing"])
          and summary["verdict"]["culprits"] and summary["verdict"]["culprits"][0]["rank"] == 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ras-out")))
