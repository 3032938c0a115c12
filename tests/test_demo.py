"""The README's first command, `./dev demo`, as a new user sees it: piped, no root, no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def processes_with_env(needle: str) -> list[int]:
    """Live processes (not zombies) whose environment holds ``needle``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle.encode() in env:
            found.append(int(entry))
    return found


def test_the_demo_ends_in_a_stored_incident_that_names_the_hang_and_leaves_nothing_running(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    env.pop("PYTHONUNBUFFERED", None)  # a new user's shell has none: stdout into a pipe is block-buffered
    res = subprocess.run([sys.executable, "-m", "hangwatchd.demo"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    # Piped, the demo's lines still come in the order things happened.
    assert lines[0].startswith(f"demo: state and runtime dirs under {tmp_path / 'hangwatchd-demo'}"), lines[:3]
    assert lines.index("step 30: waiting for a peer that never comes") > 1
    (title,) = [ln for ln in lines if ln.startswith("Incident ")]
    assert title.endswith("(complete)")
    # The status printed right after "incident stored" names that incident on the hung workload's row.
    header = next(i for i, ln in enumerate(lines) if ln.startswith("PID ") and "INCIDENT" in ln)
    (row,) = [ln for ln in lines[header + 1:header + 3] if " demo " in ln]
    assert title.split()[1] in row.split() and row.split()[3] in ("hung", "captured"), row
    assert any(ln.strip().startswith("> wait_for_peer") and "workload.py" in ln for ln in lines)
    (counter,) = [ln for ln in lines if ln.startswith("/metrics: hangwatchd_hangs_total{")]
    assert 'reason="heartbeat"' in counter and counter.endswith(" 1.0")
    # The incident stays, and the command the demo's last line gives shows it again.
    again = lines[-1].removeprefix("demo: see it again: ").split()
    assert again[1:3] == ["show", title.split()[1]], lines[-1]
    shown = subprocess.run(again, capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0 and title in shown.stdout, shown.stderr
    # Everything the demo started (daemon, launcher, workload, py-spy) inherited its XDG_STATE_HOME.
    left = processes_with_env(f"XDG_STATE_HOME={tmp_path}")
    end = time.monotonic() + 5  # a moment for a SIGTERMed process to finish exiting
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = processes_with_env(f"XDG_STATE_HOME={tmp_path}")
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
