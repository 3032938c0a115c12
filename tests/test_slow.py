"""Slow is a hang in the making: a real daemon names the rank that holds a synchronous job back, and why.

Four real ranks meet every step (gloo through PyTorch where it is installed, else a TCP
barrier of the test's own: tests/cause/pace_job.py), each launched by ``hangwatchd run`` and
beating once a step. Every slowdown is set relative to the job's own baseline as the daemon
learned it (a machine shared with other work has its own pace), and every check is on what a
user sees: the stored incident, its verdict, /metrics, the log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.testing import ScratchDaemon, stop, wait_for
from tests.s3server import S3Server, free_port

from .conftest import hangwatchd

JOB_SCRIPT = Path(__file__).parent / "cause" / "pace_job.py"
BACKEND = "gloo" if importlib.util.find_spec("torch") is not None else "barrier"
# Quick to judge on a test machine: an episode after 12 s over a 12 % margin, each rank sampled
# every 2 s, five times as often while the job is slower (the default is 60 s, 15 %, 10 s).
PACE = {"pyspy_native": False, "gpu_dump": "never", "slow_for": 12.0, "slow_margin": 0.12, "slow_sample_interval": 2.0,
        "pyspy_samples_per_uid": 20.0, "slow_window": 120.0, "capture_steps": ["proc", "progress", "pyspy", "nvml"]}
WITHIN = 120.0  # seconds from a slowdown to its incident


class Job:
    """WORLD ranks of job ``name`` meeting every step, rank r under the daemon ``daemons[r]``."""

    def __init__(self, base: Path, daemons: list[ScratchDaemon], name: str, backend: str = BACKEND) -> None:
        self.control = base / f"{name}-control.json"
        self.control.write_text("{}")
        self.name = name
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        for r, d in enumerate(daemons):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(len(daemons)), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), PACE_BACKEND=backend, PACE_CONTROL=str(self.control), PACE_COMPUTE_S="0.01",
                       PACE_DEVICE_S="0.09")
            self.procs.append(d.run([sys.executable, str(JOB_SCRIPT)], "--job", name, "--rank", str(r),
                                    "--heartbeat-timeout", "10", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def set(self, **what: dict[int, float]) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: {str(r): v for r, v in ranks.items()} for k, ranks in what.items()}))
        tmp.replace(self.control)

    def stop(self) -> None:
        stop(*self.procs)


def baseline(d: ScratchDaemon, job: str) -> float:
    """The job's baseline as the daemon learned it (seconds a step)."""
    return wait_for(lambda: d.metric("hangwatchd_job_step_baseline_seconds", workload_job=job), 120,
                    "the job's baseline on /metrics", every=1.0)


def slow_incidents(d: ScratchDaemon) -> list[dict[str, Any]]:
    return sorted((i for i in d.store().list() if i["reason"] == "slow"), key=lambda i: i["time"])


def analysis(inc: dict[str, Any]) -> dict[str, Any]:
    return json.loads((Path(inc["dir"]) / "incident.json").read_text())["analysis"]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[ScratchDaemon]:
    with ScratchDaemon(tmp_path / "d", config=PACE) as d:
        yield d


def test_the_rank_made_slower_by_compute_then_the_one_starved_of_input_are_each_named_with_their_cause(
        tmp_path: Path, daemon: ScratchDaemon) -> None:
    d = daemon
    job = Job(tmp_path, [d] * 4, "pace")
    try:
        base = baseline(d, "pace")
        # Rank 2 does a quarter of a step more compute each step.
        job.set(compute={2: 0.25 * base})
        started = time.monotonic()
        (first,) = wait_for(lambda: slow_incidents(d), WITHIN, "the first slow incident", every=1.0)
        took = time.monotonic() - started
        a = analysis(first)
        assert a["pace"]["rank"] == 2 and a["pace"]["cause"] == "cpu-bound", a["summary"]
        assert f"rank 2 on {os.uname().nodename} holds it back" in a["summary"], a["summary"]
        assert "CPU-bound in its own code at extra_compute (pace_job.py:" in a["summary"], a["summary"]
        (culprit,) = a["culprits"]
        assert culprit["rank"] == 2 and culprit["location"].startswith("extra_compute ")
        assert {r["rank"]: r["verdict"] for r in a["ranks"]} == {0: "waits-for-slow-rank", 1: "waits-for-slow-rank",
                                                                  2: "slow-rank", 3: "waits-for-slow-rank"}
        assert a["pace"]["wait_share"] < a["pace"]["others_wait_share"]
        # Stacks and NVML only, of every rank, and nothing that pauses or ends them.
        data = json.loads((Path(first["dir"]) / "incident.json").read_text())
        steps = {s["step"] for p in data["processes"] for s in p["steps"]}
        assert sorted(p["rank"] for p in data["processes"]) == [0, 1, 2, 3] and steps == {"proc", "pyspy", "nvml"}
        assert all(p.poll() is None for p in job.procs)
        assert d.metric("hangwatchd_job_slow", workload_job="pace", rank="2", cause="cpu-bound") == 1.0
        assert d.metric("hangwatchd_last_incident_timestamp_seconds", reason="slow", workload_job="pace",
                        incident=first["id"]) is not None
        assert d.metric("hangwatchd_hangs_total", reason="heartbeat") == 0.0
        print(f"compute: named in {took:.0f} s: {a['summary']}")

        # Rank 2 back to its pace: the episode ends, and with it the alert's series.
        job.set()
        d.event("job_slow_ended", seconds=WITHIN, job="pace")
        wait_for(lambda: d.metric("hangwatchd_job_slow", workload_job="pace") is None, 10, "the episode off /metrics")

        # Rank 1's input worker takes half a step more than a step for each batch: it waits for it a third of the time.
        base = d.metric("hangwatchd_job_step_baseline_seconds", workload_job="pace") or base
        job.set(starve={1: 1.5 * base})
        started = time.monotonic()
        second = wait_for(lambda: slow_incidents(d)[1:], WITHIN, "the second slow incident", every=1.0)[0]
        took = time.monotonic() - started
        a = analysis(second)
        assert a["pace"]["rank"] == 1 and a["pace"]["cause"] == "input-starved", a["summary"]
        assert "its input pipeline is starved" in a["summary"] and "blocked, not computing" in a["summary"], a["summary"]
        print(f"input: named in {took:.0f} s: {a['summary']}")

        # Slow, then hung: rank 3 stops before its collective, and the job gets its hang incident.
        job.set(starve={1: 1.5 * base}, hang={3: 1})
        hung = wait_for(lambda: [i for i in d.store().list() if i["reason"] == "heartbeat"], 60, "the hang incident", every=1.0)
        assert "Rank 3" in hung[0]["summary"], hung[0]["summary"]
        assert len(slow_incidents(d)) == 2  # one incident per episode
    finally:
        job.stop()


def test_a_job_across_two_nodes_names_the_slowest_rank_of_the_whole_job(tmp_path: Path, s3: S3Server) -> None:
    """Ranks 0 and 1 under one daemon, 2 and 3 under another (two nodes, one store): rank 3 is made
    slower. The node of rank 3 files the one incident, naming it with the other node's ranks in
    view; the other node sees its ranks wait for a rank elsewhere; the store names rank 3 too."""
    config = {**PACE, "store_poll_interval": 0.5, "slow_publish_interval": 1.0}
    with ScratchDaemon(tmp_path / "a", "--store", s3.url(), "--node-name", "node-a", env=s3.env, config=config) as a, \
            ScratchDaemon(tmp_path / "b", "--store", s3.url(), "--node-name", "node-b", env=s3.env, config=config) as b:
        job = Job(tmp_path, [a, a, b, b], "wide", backend="barrier")
        try:
            base = max(baseline(a, "wide"), baseline(b, "wide"))
            job.set(compute={3: 0.3 * base})
            (inc,) = wait_for(lambda: slow_incidents(b), WITHIN, "the slow incident on node-b", every=1.0)
            got = analysis(inc)
            assert (got["pace"]["rank"], got["pace"]["node"], got["pace"]["cause"]) == (3, "node-b", "cpu-bound"), got["summary"]
            assert "rank 3 on node-b holds it back" in got["summary"]
            assert got["pace"]["nodes"] == ["node-a", "node-b"]  # the other node's ranks were in view
            assert {(r["rank"], r["node"]) for r in got["ranks"]} == {(0, "node-a"), (1, "node-a"), (2, "node-b"), (3, "node-b")}
            elsewhere = a.event("job_slow_elsewhere", seconds=WITHIN, job="wide")  # node-a judges on its own clock
            assert (elsewhere["rank"], elsewhere["node"]) == (3, "node-b")
            assert slow_incidents(a) == []  # one episode, one incident: on the node of the rank that holds the job back
            seen = [ln for ln in a.scrape().splitlines() if ln.startswith("hangwatchd_job_slow{")]
            assert len(seen) == 1 and 'rank="3"' in seen[0] and 'rank_node="node-b"' in seen[0], seen

            res = hangwatchd("analyze", "--store", s3.url(), "--job", "wide", "--json", env=s3.env)
            assert res.returncode == 0, res.stderr
            pace = json.loads(res.stdout)["pace"]
            assert (pace["pace"]["rank"], pace["pace"]["node"], pace["pace"]["cause"]) == (3, "node-b", "cpu-bound"), pace["summary"]
            text = hangwatchd("analyze", "--store", s3.url(), "--job", "wide", env=s3.env).stdout
            assert "rank 3 on node-b holds it back" in text and "Culprit: rank 3 (pid" in text, text
        finally:
            job.stop()


def test_a_rank_on_a_throttled_gpu_is_named_with_the_throttle_reason_from_nvml_over_the_window(tmp_path: Path) -> None:
    """Three ranks, each on a GPU of its own as NVML tells it (tests/fake_nvml: NVML's API over files,
    the daemon's own probe reading it), GPU 1 held at 56 % of its clocks for heat. Rank 1 is slower
    (its kernels, as a throttled GPU would make them): the incident names its GPU's throttling, read
    by the daemon while the job was slower, and its NVML step says the same."""
    from .test_act import FAKE_NVML

    nvml = tmp_path / "nvml"
    nvml.mkdir()
    (nvml / "gpus").write_text("3")
    env = {"HANGWATCHD_FAKE_NVML": str(nvml), "PYTHONPATH": os.pathsep.join(p for p in (str(FAKE_NVML), os.environ.get("PYTHONPATH", "")) if p)}
    with ScratchDaemon(tmp_path / "d", env=env, config=PACE) as d:
        job = Job(tmp_path, [d] * 3, "hot", backend="barrier")
        try:
            def pids() -> dict[int, int] | None:
                got = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)["processes"]
                ranks = {p["rank"]: p["pid"] for p in got if p.get("job") == "hot"}
                return ranks if len(ranks) == 3 else None

            pid = wait_for(pids, 60, "the three ranks registered", every=0.5)
            devices: dict[str, dict[str, Any]] = {str(r): {"processes": [{"pid": pid[r], "sm": 45}]} for r in range(3)}
            devices["1"].update(sm_clock=1100, sm_clock_max=1980, reasons=0x40, temperature=91)  # thermal (hardware)
            (nvml / "devices.json").write_text(json.dumps(devices))
            base = baseline(d, "hot")
            job.set(compute={1: 0.3 * base})
            (inc,) = wait_for(lambda: slow_incidents(d), WITHIN, "the slow incident", every=1.0)
            a = analysis(inc)
            assert (a["pace"]["rank"], a["pace"]["cause"]) == (1, "gpu-throttled"), a["summary"]
            assert "its GPU 1 is throttled (thermal (hardware)): SM clock at 56% of its max" in a["summary"] and "91 °C" in a["summary"]
            assert a["culprits"][0]["gpu"] == 1
            record = json.loads((Path(inc["dir"]) / "slow.json").read_text())["records"][0]
            assert [g["throttle"] for g in record["gpus"]] == [[], ["thermal (hardware)"], []]
            nvml_json = json.loads((Path(inc["dir"]) / str(pid[1]) / "nvml.json").read_text())
            assert nvml_json["process_gpus"] == [1] and nvml_json["devices"][1]["throttle_reasons"] == ["thermal (hardware)"]
        finally:
            job.stop()
