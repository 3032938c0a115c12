"""Detection latency: 20 workloads that beat, then stop, under a real daemon with a 3 s timeout.

For each: from the workload's last beat to the daemon declaring it hung, and to its
incident (with stacks) being stored. The baseline is the timeout itself: the ratio
says how close to the theoretical best (declared exactly at the timeout) we are.

Targets: every stall declared within timeout + 1 s, stored within timeout + 3 s.
"""

from __future__ import annotations

import datetime
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hangwatchd.testing import ScratchDaemon, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figures import Figure, report

TIMEOUT = 3.0
TRIALS = 20
AT_ONCE = 5
ALONE = 3  # the baseline's workloads, one at a time


def ts(event: dict[str, object]) -> float:
    return datetime.datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def main() -> None:
    seen: set[int] = set()
    declared: list[float] = []
    stored: list[float] = []
    code = ("import time, hangwatchd, threading\n"
            "for _ in range(10): time.sleep(0.05); hangwatchd.beat()\n"
            "print(time.time(), flush=True)\nthreading.Event().wait()\n")
    alone_declared: list[float] = []
    alone_stored: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, ScratchDaemon(Path(tmp)) as d:
        # The baseline: one workload at a time, same daemon, same timeout.
        for _ in range(ALONE):
            p = d.run([sys.executable, "-c", code], "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
            assert p.stdout is not None
            last = float(p.stdout.readline())
            (inc,) = wait_for(lambda: [i for i in d.settled() if i["processes"][0] not in seen], TIMEOUT + 15, "its incident")
            seen.add(inc["processes"][0])
            logs = d.logs()
            alone_declared.append(ts(next(e for e in logs if e.get("event") == "process_hung" and e.get("pid") == inc["processes"][0])) - last)
            alone_stored.append(ts(next(e for e in logs if e.get("event") == "incident_stored_first" and e.get("incident") == inc["id"])) - last)
            p.terminate()
            p.wait()
        for batch in range(TRIALS // AT_ONCE):
            procs = [d.run([sys.executable, "-c", code], "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
                     for _ in range(AT_ONCE)]
            started: dict[subprocess.Popen[bytes], float] = {}
            for p in procs:
                assert p.stdout is not None
                started[p] = float(p.stdout.readline())
            want = (batch + 1) * AT_ONCE + ALONE
            wait_for(lambda want=want: len(d.settled()) >= want, TIMEOUT + 15, "the incidents")  # type: ignore[misc]  # a default binds the loop's value
            logs = d.logs()
            for inc in d.store().list()[: AT_ONCE]:
                pid = inc["processes"][0]
                hung = next(e for e in logs if e.get("event") == "process_hung" and e.get("pid") == pid)
                done = next(e for e in logs if e.get("event") == "incident_stored_first" and e.get("incident") == inc["id"])
                launcher = next(p for p in procs if Path(f"/proc/{pid}/stat").exists() and
                                int(Path(f"/proc/{pid}/stat").read_text().split()[3]) == p.pid)
                declared.append(ts(hung) - started[launcher])
                stored.append(ts(done) - started[launcher])
            for p in procs:
                p.terminate()
                p.wait()
    base_declared = f"one at a time ({ALONE}): median {statistics.median(alone_declared):.2f} s, max {max(alone_declared):.2f} s"
    base_stored = f"one at a time ({ALONE}): median {statistics.median(alone_stored):.2f} s, max {max(alone_stored):.2f} s"
    report("detect", [
        Figure("last beat to declared hung", f"median {statistics.median(declared):.2f} s, max {max(declared):.2f} s", base_declared,
               f"max within {TIMEOUT + 1:g} s", max(declared) <= TIMEOUT + 1),
        Figure("last beat to incident stored with stacks", f"median {statistics.median(stored):.2f} s, max {max(stored):.2f} s",
               base_stored, f"max within {TIMEOUT + 3:g} s", max(stored) <= TIMEOUT + 3),
    ], note=f"{TRIALS} workloads, {AT_ONCE} at a time, under a real daemon")

if __name__ == "__main__":
    main()
