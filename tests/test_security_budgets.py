"""The trust boundary over time: budgets, dumps, the shared store and what is shown.

The daemon runs as root and the attacker as uid 65534 (nobody), with real files,
FIFOs, processes, a real S3 server and the real CLI. Each test is one finding of
issue 17 (the part about budgets, dumps, the store and the terminal): what a
user of the node would see, and, where the attack could delay others, that a
root workload's hang during it is still stored within its timeout + 10 s.
Tests that need root skip, saying so, as an ordinary user.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangwatchd.testing import Daemon, stop, wait_for

from .conftest import FIXTURES
from .test_security import (  # noqa: F401 - fixtures
    NOBODY,
    QUICK,
    SYSTEM_PYTHON,
    TIMEOUT,
    Attacker,
    RootHang,
    attacker,
    base,
    needs_root,
    nobody_can_read,
)

GiB = 1 << 30
SLACK = 10.0  # a root workload's hang is stored within its timeout + this, whatever the attack


def stored_within(victim: RootHang, slack: float = SLACK) -> dict[str, object]:
    """The root workload's incident, stored within its timeout + ``slack`` seconds of its last beat."""
    stopped = wait_for(lambda: victim.stopped, 60, "the root workload's last beat")[0]

    def mine() -> dict[str, object] | None:
        return next((i for i in victim.d.store().list() if i["job"] == victim.job and i["reason"] == "heartbeat"), None)

    inc = wait_for(mine, TIMEOUT + slack + 30, "the root workload's incident")
    took = time.monotonic() - stopped
    assert took <= TIMEOUT + slack, f"the root workload's hang took {took:.1f} s to be stored during the attack"
    print(f"root hang stored {took:.2f} s after its last beat (timeout {TIMEOUT:g} s)")
    return inc


def events(d: Daemon, name: str) -> list[dict[str, object]]:
    return [e for e in d.logs() if e.get("event") == name]


# -- High 5: retention counts what it owns ------------------------------------

@needs_root
def test_a_sparse_60_gib_file_in_the_dump_dir_deletes_no_incident(base: Path, attacker: Attacker) -> None:
    config = dict(QUICK, max_state_bytes="1GiB")
    with Daemon(base / "d", config=config) as d:
        victim = RootHang(d)
        try:
            kept = stored_within(victim)
        finally:
            victim.stop()
        dump_dir = Path(d.info["dump_dir"])
        # Where users write is not where root keeps incidents.
        assert not dump_dir.resolve().is_relative_to(d.state_dir.resolve())
    # Planted while the daemon is down; retention runs first thing at the next start.
    attacker.run(f"""
import os
for where in ({str(dump_dir)!r}, {str(d.state_dir / 'dumps')!r}):
    try:
        with open(os.path.join(where, 'core_x.1.1.nvcudmp.part'), 'wb') as f:
            f.truncate(60 << 30)
    except OSError:
        pass
""")
    assert (dump_dir / "core_x.1.1.nvcudmp.part").stat().st_size == 60 * GiB
    with Daemon(base / "d", config=config) as d:
        checked = wait_for(lambda: events(d, "retention_checked"), 20, "retention to run")
        assert int(checked[0]["store_bytes"]) < 64 << 20  # its own incidents, not the planted file
        assert events(d, "retention_removed") == []
        assert [i["id"] for i in d.store().list()] == [kept["id"]]
        assert Path(str(kept["dir"])).is_dir()


# -- High 6: the GPU-dump gate reads native frames; one user's flood takes one worker ----

def capture_steps(inc: dict[str, object]) -> list[dict[str, object]]:
    data = json.loads((Path(str(inc["dir"])) / "incident.json").read_text())
    return [s for p in data["processes"] for s in p["steps"]]


@needs_root
def test_processes_named_like_hung_gpu_work_take_no_gpu_dump_and_delay_no_one(base: Path, attacker: Attacker) -> None:
    bait = base / "bait"
    bait.mkdir()
    os.chown(bait, NOBODY, NOBODY)
    config = {"rescan_interval": 1.0, "capture_timeout": 30.0, "flight_recorder_timeout": 4.0, "gpu_dump": "confirmed"}
    with Daemon(base / "d", config=config) as d:  # py-spy --native, as deployed: the gate sees native frames
        evil = []
        for i in range(8):
            env = {"PATH": "/usr/bin:/bin", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(bait / f"fr{i}_"),
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(bait / f"trace{i}_"), "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1",
                   "CUDA_COREDUMP_PIPE": str(bait / "corepipe.%p"), "CUDA_COREDUMP_FILE": str(bait / "core_%p.nvcudmp")}
            p = attacker.spawn([SYSTEM_PYTHON, str(Path(__file__).with_name("attacker.py")), "register", str(d.runtime_dir),
                                "--timeout", "1", "--bait", str(bait)],
                               user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env=env, stdout=subprocess.PIPE)
            assert p.stdout is not None and p.stdout.readline().startswith("registered")
            evil.append(p.pid)
        victim = RootHang(d)
        try:
            stored_within(victim)
            # The rest of the user's captures waited for its one slot; no worker of anyone else's was taken.
            over = wait_for(lambda: [e for e in events(d, "capture_over_budget") if e.get("uid") == NOBODY], 20,
                            "the attacker's captures held to its budget")
            assert "captures_per_uid = 1" in str(over[0]["error"])
            theirs = wait_for(lambda: [i for i in d.store().list() if set(i["processes"]) & set(evil)], 30,
                              "an attacker's hang captured")
            for inc in theirs:
                (dump,) = [s for s in capture_steps(inc) if s["step"] == "cuda_dump"]
                assert dump.get("skipped") and "not confirmed" in str(dump["error"]), dump
            assert all(Path(f"/proc/{pid}").exists() for pid in evil)  # no GPU dump was asked of any of them
            assert d.proc.poll() is None
        finally:
            victim.stop()
            attacker.stop()
