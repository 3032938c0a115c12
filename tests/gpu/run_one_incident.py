"""One hang, one incident, on a GPU: a discovered process spinning in a GPU kernel, held for
HOLD seconds, is declared hung exactly once (issue 18). Runs on a GPU machine, never in CI.

    PYTHONPATH=. python3 tests/gpu/run_one_incident.py OUTDIR [--hold 120]

A daemon with discovery on (no GPU dump, so the process lives on and keeps being sampled)
watches tests/gpu/spin_unwatched.py, which never imports hangwatchd. The scenario counts the
daemon's ``process_hung`` events for that pid over the hold (not incidents after a sleep),
checks that sampling went on all along (``hangwatchd_stack_samples_total``) and that nothing
was taken for a recovery, and prints ``ONE_INCIDENT ok`` (exit 0) or ``ONE_INCIDENT FAILED``
(exit 1) with the counts; OUTDIR/one_incident.json holds them and OUTDIR/daemon.log the log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.testing import ScratchDaemon, stop, wait_for  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("outdir", type=Path)
    p.add_argument("--hold", type=float, default=120.0)
    args = p.parse_args()
    out: Path = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    base = out / "one_incident"
    shutil.rmtree(base, ignore_errors=True)
    config = {"discover": True, "rescan_interval": 1.0, "stack_interval": 2.0, "stack_window": 10.0,
              "gpu_dump": "never", "capture_timeout": 60.0}
    d = ScratchDaemon(base, config=config)
    work = subprocess.Popen([sys.executable, str(ROOT / "tests" / "gpu" / "spin_unwatched.py")],
                            stdout=subprocess.PIPE, start_new_session=True)
    result: dict[str, object] = {}
    try:
        assert work.stdout is not None
        line = work.stdout.readline().decode().strip()
        assert line.startswith("STALL"), line

        def events(name: str) -> list[dict]:
            return [e for e in d.logs() if e.get("event") == name and (e.get("pid") == work.pid or work.pid in (e.get("pids") or []))]

        wait_for(lambda: events("incident_stored"), 180, "the first incident", every=1.0)
        first = time.monotonic()
        samples0 = d.metric("hangwatchd_stack_samples_total", kind="plain", outcome="ok") or 0.0
        while time.monotonic() - first < args.hold:
            time.sleep(5)
            if work.poll() is not None:
                break
        samples = (d.metric("hangwatchd_stack_samples_total", kind="plain", outcome="ok") or 0.0) - samples0
        hung, stored, recovered = events("process_hung"), events("incident_stored"), events("process_recovered")
        result = {"pid": work.pid, "held_s": round(time.monotonic() - first, 1), "process_hung": len(hung),
                  "incident_stored": len(stored), "process_recovered": len(recovered),
                  "plain_samples_during_hold": samples, "alive": work.poll() is None,
                  "detail": hung[0].get("detail") if hung else None}
    finally:
        stop(work, sig=signal.SIGKILL, group=True)
        d.stop()
        shutil.copy(d.log, out / "daemon.log")
    ok = (result.get("process_hung") == 1 and result.get("incident_stored") == 1 and result.get("process_recovered") == 0
          and float(result.get("plain_samples_during_hold") or 0) >= args.hold / 2 / 2 and bool(result.get("alive")))
    (out / "one_incident.json").write_text(json.dumps(result, indent=1))
    print(f"ONE_INCIDENT {'ok' if ok else 'FAILED'} {json.dumps(result)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
