"""A process's life in the daemon: one hang is one incident, however long it lasts; a hang is
captured as a transaction (never left hung without an incident); every capture step's bug is a
failed step; the status file says which timeout applies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangwatchd.testing import Daemon, stop, wait_for, workload_argv

from .conftest import hangwatchd

HELD = 60.0  # seconds each hang is kept after it was first declared

DEADLOCK = """
import threading
a = threading.Lock()
a.acquire()
def frozen_on_a_lock():
    a.acquire()
frozen_on_a_lock()
"""

SLEEP_LOOP = """
import time
def waiting_in_a_loop():
    while True:
        time.sleep(0.2)
waiting_in_a_loop()
"""


def _events(d: Daemon, name: str, pid: int | None = None) -> list[dict]:
    return [e for e in d.logs() if e.get("event") == name and (pid is None or e.get("pid") == pid
                                                                or pid in (e.get("pids") or []))]


def _samples_seen(d: Daemon) -> float:
    return d.metric("hangwatchd_stack_samples_total") or 0.0


def test_three_hangs_held_for_a_minute_are_each_declared_exactly_once(tmp_path: Path) -> None:
    """A never-instrumented process frozen on a lock, a process whose beats stop, and one asleep in
    a loop under a declared stack timeout: each hang is held for a minute while the daemon keeps
    sampling (the native confirming look included), and each is declared hung once."""
    config = {"stack_interval": 1.0, "gpu_dump": "never", "capture_timeout": 20.0}
    with Daemon(tmp_path, config=config) as d:
        procs = [
            d.run([sys.executable, "-c", DEADLOCK], "--stack-timeout", "3", start_new_session=True),
            d.run(workload_argv(beats=30, interval=0.05), "--heartbeat-timeout", "2", start_new_session=True),
            d.run([sys.executable, "-c", SLEEP_LOOP], "--stack-timeout", "3", start_new_session=True),
        ]
        try:
            status = wait_for(lambda: _status_of(d, 3), 20, "three processes watched")
            workloads = [p["pid"] for p in status]
            assert len(workloads) == 3
            # Each is declared hung once, and stored.
            wait_for(lambda: all(_events(d, "incident_stored", pid) for pid in workloads), 60, "an incident for each")
            first = time.monotonic()
            # Held: the daemon keeps looking at each (stack samples go on) for a minute.
            before = _samples_seen(d)
            wait_for(lambda: time.monotonic() - first >= HELD and _samples_seen(d) >= before + 60, HELD + 60,
                     "a minute of sampling", every=1.0)
            for pid in workloads:
                hung = _events(d, "process_hung", pid)
                assert len(hung) == 1, f"pid {pid} declared hung {len(hung)} times: {hung}"
                assert not _events(d, "process_recovered", pid)
            assert len(_events(d, "incident_stored")) == 3
            assert {p["state"] for p in _status_of(d, 3)} == {"captured"}
            # The incident says truthfully how long the stack held still, over how many samples.
            for inc in d.store().list():
                if inc["reason"] == "stack":
                    detail = json.loads((Path(inc["dir"]) / "incident.json").read_text())["detail"]
                    held = float(detail.split("the same stack for ")[1].split(" s")[0])
                    samples = int(detail.split("; ")[1].split(" samples")[0])
                    assert held >= 3 and samples >= 3, detail
        finally:
            for p in procs:
                stop(p, sig=signal.SIGKILL, group=True)


def _status_of(d: Daemon, n: int) -> list[dict] | None:
    out = hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout
    procs = [p for p in json.loads(out)["processes"] if p["role"] != "launcher"] if out else []
    return procs if len(procs) >= n else None
