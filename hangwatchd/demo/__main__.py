"""The README's first command: the daemon watching a workload that beats, then hangs.

No GPU and no root needed: each run gets a fresh directory of its own under
~/.local/state/hangwatchd-demo/ (earlier runs are kept, and two demos at once
do not meet). Ends by printing the stored incident and the hang counter as
Prometheus scrapes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ..cli import main as cli
from ..incidents.store import Store
from ..testing import stop, wait_for
from ..workload import runtime_files

TIMEOUT_S = 3


def demo_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "hangwatchd-demo"


def command_path() -> str:
    """The hangwatchd command next to this Python (the .venv's), as short as the user can type it."""
    path = Path(sys.executable).parent / "hangwatchd"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def names_incident(run_dir: Path, incident: str) -> bool:
    status = runtime_files.status(run_dir) or {}
    return any(p.get("incident") == incident for p in status.get("processes") or [])


def main() -> int:
    demo_dir().mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ-", time.gmtime())
    base = Path(tempfile.mkdtemp(prefix=stamp, dir=demo_dir()))  # fresh and unique, even for two at once
    state, run_dir = base / "state", base / "run"
    py = sys.executable
    print(f"demo: state and runtime dirs under {base}")
    with open(base / "daemon.log", "w") as daemon_log:
        daemon = subprocess.Popen(
            [py, "-m", "hangwatchd", "daemon", "--state-dir", str(state), "--runtime-dir", str(run_dir),
             "--metrics-address", "127.0.0.1:0", "--log-format", "console"],
            stderr=daemon_log)
        workload = None
        try:
            info = wait_for(lambda: runtime_files.daemon_info(run_dir), 20, "the daemon's start", every=0.1)
            print(f"demo: daemon pid {daemon.pid} ready, metrics on http://{info['metrics_address']}/metrics")
            workload = subprocess.Popen(
                [py, "-m", "hangwatchd", "run", "--runtime-dir", str(run_dir), "--job", "demo",
                 "--heartbeat-timeout", str(TIMEOUT_S), "--", py, "-m", "hangwatchd.demo.workload", "30"])
            started = time.monotonic()
            print(f"demo: workload beats every 0.1 s for 3 s, then waits forever (timeout {TIMEOUT_S} s)")
            store = Store(state)
            incidents = wait_for(store.list, 40, "an incident", every=0.1)
            print(f"demo: incident stored {time.monotonic() - started:.1f} s after the workload started\n")
            # The loop learns the incident a moment after the store has it, and status.json follows
            # within a second: show the status once it names the incident, never "INCIDENT -".
            wait_for(lambda: names_incident(run_dir, incidents[0]["id"]), 15, "the status to name the incident", every=0.1)
            cli(["status", "--runtime-dir", str(run_dir)])
            print()
            cli(["show", incidents[0]["id"], "--state-dir", str(state)])
            with urllib.request.urlopen(f"http://{info['metrics_address']}/metrics", timeout=5) as resp:
                # Every reason's series exists from the start (at 0, for the alerts): show the one that counted.
                hangs = [ln for ln in resp.read().decode().splitlines()
                         if ln.startswith("hangwatchd_hangs_total") and not ln.endswith(" 0.0")]
            print("\n/metrics: " + "\n/metrics: ".join(hangs))
            print(f"\ndemo: the daemon's log is {base / 'daemon.log'}; incidents stay in {state}")
            # The daemon is gone after this, so a bare 'hangwatchd show' would look in /var/lib/hangwatchd.
            print(f"demo: see it again: {command_path()} show {incidents[0]['id']} --state-dir {state}")
            return 0
        except TimeoutError as exc:
            raise SystemExit(f"demo: {exc}") from None
        finally:
            for proc in (workload, daemon):
                if proc is not None:
                    stop(proc)


if __name__ == "__main__":
    # The workload writes to the same stdout: without this, piped output (./dev demo | tee)
    # shows the workload's line before the demo's own first lines.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a program's stdout is a TextIOWrapper
    sys.exit(main())
