"""Two daemons on one 2-GPU host standing for two nodes, sharing one S3 store (moto's server on
loopback); a real NCCL job with one rank under each; prints the merged verdict.

    PYTHONPATH=. python3 tests/gpu/run_nodes.py OUTDIR [HOLD_SECONDS]   # needs moto[server] and boto3 installed

Rank 0 (node-a, GPU 0) hangs in an all_gather; rank 1 (node-b, GPU 1) took another branch and
keeps beating. Node-a declares the job hung, node-b captures rank 1 on its request, and
`hangwatchd analyze --store URL --job JOB --json` should name rank 1 on node-b. With HOLD_SECONDS the
hang goes on that long after the merged verdict, and each daemon's hangs and stored incidents are
counted (one job hang: one incident a node).
"""

from __future__ import annotations

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

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, wait_for  # noqa: E402
from tests.s3server import S3Server, free_port  # noqa: E402

JOB = "gpu-nodes"
CONFIG = {"gpu_dump": "confirmed", "pyspy_timeout": 20.0, "flight_recorder_timeout": 30.0, "store_poll_interval": 1.0}


def main(out: Path, hold: float = 0.0) -> int:
    try:
        import moto  # noqa: F401
    except ImportError:
        print("run_nodes: moto is not installed here; pip install 'moto[server]' (the lead carries the wheels)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    base = Path("/tmp/hangwatchd-nodes")
    shutil.rmtree(base, ignore_errors=True)
    s3 = S3Server().start()
    daemons = {name: ScratchDaemon(base / name, "--store", s3.url(), "--node-name", name, env=s3.env, config=CONFIG)
               for name in ("node-a", "node-b")}
    port = free_port()
    ranks: list[subprocess.Popen[str]] = []
    start = time.time()
    try:
        for rank, name in enumerate(daemons):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            ranks.append(subprocess.Popen(hangwatchd_argv(
                "run", "--runtime-dir", str(daemons[name].runtime_dir), "--job", JOB, "--rank", str(rank),
                "--heartbeat-timeout", "10", "--", sys.executable, str(ROOT / "tests/gpu/diverge_nodes.py")),
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))

        def both() -> dict | None:
            res = subprocess.run(hangwatchd_argv("analyze", "--store", s3.url(), "--job", JOB, "--json"),
                                 capture_output=True, text=True, env=dict(os.environ, **s3.env))
            if res.returncode != 0:
                return None
            got = json.loads(res.stdout)
            return got if len([r for r in got["ranks"] if r.get("node")]) == 2 else None

        result = wait_for(both, 300, "both ranks in the store", every=1.0)
        (out / "analysis.json").write_text(json.dumps(result, indent=1))
        listed = subprocess.run(hangwatchd_argv("incidents", "--store", s3.url()), capture_output=True, text=True,
                                env=dict(os.environ, **s3.env))
        (out / "incidents.txt").write_text(listed.stdout + listed.stderr)
        print(f"merged verdict {time.time() - start:.1f} s after the job started:")
        print(result["summary"])
        for c in result["culprits"]:
            print(f"  culprit: rank {c['rank']} on {c['node']}: {c['reason']} at {c['location']}")
        for r in result["ranks"]:
            print(f"  rank {r['rank']} on {r['node']}: {r['verdict']} - {r['detail']}")
        print(listed.stdout)
        time.sleep(hold)  # the hang goes on: count what each daemon makes of it
        counts = {name: {ev: sum(1 for e in d.logs() if e.get("event") == ev) for ev in ("process_hung", "incident_stored")}
                  for name, d in daemons.items()}
        print(f"after holding the hang {hold:.0f} s more: {json.dumps(counts)}")
        (out / "counts.json").write_text(json.dumps({"held_s": hold, **counts}))
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            try:
                text = p.communicate(timeout=10)[0]
            except subprocess.TimeoutExpired:
                text = ""
            (out / f"rank-{ranks.index(p)}.log").write_text(text or "")
        for name, d in daemons.items():
            d.stop()
            shutil.copy(d.log, out / f"daemon-{name}.log")
        s3.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/nodes-out"), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0))
