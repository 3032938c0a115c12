"""The diverged two-rank job on a 2-GPU machine, through the real daemon; keeps the incident.

    PYTHONPATH=. [DIVERGE_MODE=sizes] python3 tests/gpu/run_diverge.py OUTDIR
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, wait_for  # noqa: E402


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    base = Path("/tmp/hangwatchd-diverge")
    shutil.rmtree(base, ignore_errors=True)
    d = ScratchDaemon(base, config={"gpu_dump": "confirmed", "pyspy_timeout": 20.0, "flight_recorder_timeout": 30.0})
    job = None
    try:
        job = subprocess.Popen(["torchrun", "--nproc-per-node", "2", "--no-python", *hangwatchd_argv(
            "run", "--runtime-dir", str(d.runtime_dir), "--heartbeat-timeout", "10", "--"), sys.executable,
            str(ROOT / "tests/gpu/diverge.py")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)  # its own group: torchrun, the launchers and the ranks go down together
        inc = wait_for(d.settled, 240, "the incident", every=0.5)[0]
        res = subprocess.run(hangwatchd_argv("analyze", inc["dir"], "--json"), capture_output=True, text=True)
        (out / "analysis.json").write_text(res.stdout + res.stderr)
        show = subprocess.run(hangwatchd_argv("show", inc["id"], "--state-dir", str(d.state_dir)), capture_output=True, text=True)
        (out / "show.txt").write_text(show.stdout + show.stderr)
        with tarfile.open(out / "incident.tar.xz", "w:xz") as tar:  # small: the raw GPU dumps stay behind
            tar.add(inc["dir"], arcname="diverged-incident", filter=lambda t: None if t.name.endswith(".zst") else t)
        print(show.stdout[:3000])
        print(json.dumps(json.loads(res.stdout), indent=1)[:3000] if res.returncode == 0 else res.stderr)
    finally:
        if job is not None:
            # By group, never by name: SIGTERM lets torchrun stop its workers (its own
            # sessions), whose workloads die with their hangwatchd run; then SIGKILL what is left.
            out_text = ""
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(job.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    out_text = job.communicate(timeout=15)[0]
                    break
                except subprocess.TimeoutExpired:
                    continue
            (out / "torchrun.log").write_text(out_text or "")
        d.stop()
        shutil.copy(d.log, out / "daemon.log")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/diverge-out")))
