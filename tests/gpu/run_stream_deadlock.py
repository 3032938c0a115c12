"""The stream deadlock through the real daemon on a GPU machine; keeps the incident.

    PYTHONPATH=. python3 tests/gpu/run_stream_deadlock.py OUTDIR

Expect: one `heartbeat` incident whose verdict is `stream-deadlock`, naming the
driver call (cuLaunchKernel), prefetch_next_batch (stream_deadlock.py) and, from
the GPU dump and NVML, that nothing runs on the process's GPU; `nccl_ras` n/a.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, wait_for  # noqa: E402


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    base = Path("/tmp/hangwatchd-stream")
    shutil.rmtree(base, ignore_errors=True)
    d = ScratchDaemon(base, config={"gpu_dump": "confirmed", "pyspy_timeout": 20.0})
    work = None
    try:
        work = d.run([sys.executable, str(ROOT / "tests/gpu/stream_deadlock.py")], "--heartbeat-timeout", "5",
                     "--job", "stream", stdout=subprocess.PIPE, text=True)
        assert work.stdout is not None
        stall = float(work.stdout.readline().split()[1])
        inc = wait_for(d.settled, 180, "the incident", every=0.5)[0]
        stored = time.time()
        res = subprocess.run(hangwatchd_argv("analyze", inc["dir"], "--json"), capture_output=True, text=True)
        (out / "analysis.json").write_text(res.stdout + res.stderr)
        show = subprocess.run(hangwatchd_argv("show", inc["id"], "--state-dir", str(d.state_dir)), capture_output=True, text=True)
        (out / "show.txt").write_text(show.stdout + show.stderr)
        with tarfile.open(out / "incident.tar.xz", "w:xz") as tar:
            tar.add(inc["dir"], arcname="stream-deadlock-incident", filter=lambda t: None if t.name.endswith(".zst") else t)
        verdict = json.loads(res.stdout)["ranks"][0] if res.returncode == 0 else {}
        summary = {"verdict": verdict.get("verdict"), "detail": verdict.get("detail"), "location": verdict.get("location"),
                   "stall_to_listed_s": round(stored - stall, 1)}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(show.stdout[:3000])
        print(json.dumps(summary, indent=1))
        return 0 if summary["verdict"] == "stream-deadlock" else 1
    finally:
        if work is not None and work.poll() is None:
            work.kill()
            work.wait()
        d.stop()
        shutil.copy(d.log, out / "daemon.log")


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/stream-deadlock-out")))
