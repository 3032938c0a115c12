"""The project's alert rules against a real Prometheus server scraping real daemons every second.

promtool's unit tests feed hand-written series that start at 0; a real daemon's
counters are what Prometheus really sees. Each alert must fire on the *first*
event of its kind on a fresh daemon: a counter born at 1 on first use would
show no increase() and never fire.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

from .conftest import FIXTURES, hangwatchd

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "config" / "alerts.yaml"
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus server is not installed (./dev test installs Debian's)")

FAST = {"stack_interval": 0.5, "stack_window": 3.0, "pyspy_native": False, "gpu_dump": "never",
        "capture_steps": ["proc", "pyspy"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def documented_scrape_configs(targets: list[str]) -> list[dict[str, Any]]:
    """The scrape config exactly as docs/operating.md tells an operator to write it, its one
    example target replaced by ours: what the alerts and the dashboard meet in the field."""
    doc = (ROOT / "docs" / "operating.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", doc, re.S)]
    (block,) = [b for b in blocks if isinstance(b, dict) and "scrape_configs" in b]
    (scrape,) = block["scrape_configs"]
    (static,) = scrape["static_configs"]
    assert scrape["job_name"] == "hangwatchd" and len(static["targets"]) == 1, scrape
    static["targets"] = targets
    return [scrape]


class Prometheus:
    """A real Prometheus on loopback: scrapes every second, evaluates the project's rules every second."""

    def __init__(self, base: Path, targets: list[str]) -> None:
        base.mkdir(parents=True, exist_ok=True)
        # Rules as shipped, evaluated every second instead of every minute: only the interval changes.
        rules = base / "alerts.yaml"
        rules.write_text(RULES.read_text().replace("- name: hangwatchd\n", "- name: hangwatchd\n    interval: 1s\n", 1))
        assert "interval: 1s" in rules.read_text()
        cfg = base / "prometheus.yml"
        cfg.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": documented_scrape_configs(targets),
        }))
        self.port = free_port()
        self.log = open(base / "prometheus.log", "ab")
        self.proc = subprocess.Popen([PROMETHEUS or "prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={base / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=self.log)
        wait_for(self._ready, 30, "Prometheus ready", every=0.2)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]

    def firing(self, name: str, **labels: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"].get("alertname") == name and a["state"] == "firing"
                and all(a["labels"].get(k) == v for k, v in labels.items())]

    def active(self) -> list[dict[str, Any]]:
        """Every alert pending or firing now."""
        return [a for a in self.api("alerts")["alerts"] if a["state"] in ("pending", "firing")]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()


def raw_dump(dump_dir: Path, pid: int) -> None:
    path = dump_dir / f"core_{socket.gethostname()}.{pid}.1.nvcudmp"
    tmp = dump_dir / f".{path.name}.tmp"
    tmp.write_bytes(lzma.decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes()))
    tmp.replace(path)


def test_every_alert_fires_on_the_first_event_of_its_kind_on_a_fresh_daemon(tmp_path: Path) -> None:
    failing_pyspy = tmp_path / "py-spy-broken"
    failing_pyspy.write_text("#!/bin/sh\necho 'Permission denied (os error 13)' >&2\nexit 1\n")
    failing_pyspy.chmod(0o755)
    nvml = tmp_path / "nvml"  # NVML's API over files (tests/fake_nvml): a GPU fault on demand, without a GPU
    (nvml / "events").mkdir(parents=True)
    (nvml / "gpus").write_text("4")
    fake = str(Path(__file__).parent / "fake_nvml")
    good = ScratchDaemon(tmp_path / "good", env={"NODE_NAME": "node-good", "HANGWATCHD_FAKE_NVML": str(nvml),
                                          "PYTHONPATH": os.pathsep.join(p for p in (fake, os.environ.get("PYTHONPATH", "")) if p)},
                  config=FAST)
    broken = ScratchDaemon(tmp_path / "broken", env={"NODE_NAME": "node-broken", "HANGWATCHD_PYSPY": str(failing_pyspy)}, config=FAST)
    prom = Prometheus(tmp_path / "prom", [good.info["metrics_address"], broken.info["metrics_address"]])
    work: list[subprocess.Popen[bytes]] = []
    try:
        # Both daemons scraped before anything happens: every series Prometheus will judge starts here.
        wait_for(lambda: len(prom.api("query", query='up{job="hangwatchd"} == 1')["result"]) == 2, 30, "both fresh daemons scraped")
        for name in ("GPUProcessHung", "GPUExceptionDump", "HangwatchdCaptureFailing", "GPUXidError", "GPUJobAborted"):
            assert prom.firing(name) == []

        # The first event of each kind: a heartbeat hang and a stack hang on one node, an exception dump,
        # and a hang on the node whose py-spy cannot read processes.
        work.append(good.run(workload_argv(beats=5, interval=0.05), "--job", "hb", "--heartbeat-timeout", "1", "--on-hang", "abort"))
        work.append(good.run([sys.executable, "-c", "import time\ndef poll_forever():\n    while True: time.sleep(0.2)\npoll_forever()"],
                             "--job", "st", "--stack-timeout", "2", "--heartbeat-timeout", "3600"))
        raw_dump(good.dump_dir, 4242)
        (nvml / "events" / "1.json").write_text(json.dumps({"gpu": 3, "xid": 79}))
        work.append(broken.run(workload_argv(beats=5, interval=0.05), "--job", "hb", "--heartbeat-timeout", "1"))

        hb = wait_for(lambda: prom.firing("GPUProcessHung", Hostname="node-good", reason="heartbeat"), 45, "GPUProcessHung (heartbeat)")
        st = wait_for(lambda: prom.firing("GPUProcessHung", Hostname="node-good", reason="stack"), 45, "GPUProcessHung (stack)")
        exc = wait_for(lambda: prom.firing("GPUExceptionDump", Hostname="node-good"), 45, "GPUExceptionDump")
        cap = wait_for(lambda: prom.firing("HangwatchdCaptureFailing", Hostname="node-broken"), 45, "HangwatchdCaptureFailing")

        xid = wait_for(lambda: prom.firing("GPUXidError", Hostname="node-good"), 45, "GPUXidError")
        wait_for(lambda: prom.firing("GPUJobAborted", Hostname="node-good"), 45, "GPUJobAborted")

        assert (xid[0]["labels"]["gpu"], xid[0]["labels"]["xid"]) == ("3", "79")
        assert exc[0]["labels"]["type"] == "WARP_ILLEGAL_ADDRESS"
        assert cap[0]["labels"]["step"] == "pyspy"
        # Each is the first of its kind: the counter went from 0 to 1, and the annotations name the incident.
        assert good.metric("hangwatchd_hangs_total", reason="heartbeat") == 1.0
        assert good.metric("hangwatchd_hangs_total", reason="stack") == 1.0
        assert good.metric("hangwatchd_gpu_exceptions_total", type="WARP_ILLEGAL_ADDRESS") == 1.0
        ids = {i["reason"]: i["id"] for i in good.store().list()}
        wait_for(lambda: prom.firing("GPUProcessHung", Hostname="node-good", reason="heartbeat")[0]["annotations"].get("incident"),
                 20, "the incident id in the annotation")
        assert prom.firing("GPUProcessHung", Hostname="node-good", reason="heartbeat")[0]["annotations"]["incident"] == ids["heartbeat"]
        assert hb and st
        # Nothing fired that should not: the good node's py-spy worked, the broken one had no exception.
        assert prom.firing("HangwatchdCaptureFailing", Hostname="node-good") == []
        assert prom.firing("GPUExceptionDump", Hostname="node-broken") == []
    finally:
        for w in work:
            stop(w)
        prom.stop()
        good.stop()
        broken.stop()


# An idle server: waits in select() on a socket nobody connects to (idle, not hung, to the daemon).
IDLE_SERVER = ("import selectors, socket\n{opens}s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
               "sel = selectors.DefaultSelector(); sel.register(s, selectors.EVENT_READ)\n"
               "def serve_forever():\n    while True: sel.select()\nserve_forever()\n")


def test_no_alert_is_pending_or_firing_for_healthy_processes(tmp_path: Path, fake_gpu: Path) -> None:
    """Every rule against a real Prometheus scraping a daemon that watches three healthy processes,
    one of each kind: a job that beats, a server watched by its stack alone (it never beats), and
    an idle process found by discovery (it holds a GPU device file, and never beats either)."""
    config = {"pyspy_native": False, "gpu_dump": "never", "discover": True, "discover_devices": str(fake_gpu),
              "rescan_interval": 0.5, "discover_interval": 0.5}
    d = ScratchDaemon(tmp_path / "d", env={"NODE_NAME": "node-healthy"}, config=config)
    prom = Prometheus(tmp_path / "prom", [d.info["metrics_address"]])
    work: list[subprocess.Popen[bytes]] = []
    try:
        work.append(d.run(workload_argv(beats=100_000, interval=0.1), "--job", "beats", "--heartbeat-timeout", "2"))
        work.append(d.run([sys.executable, "-c", IDLE_SERVER.format(opens="")], "--job", "serve", "--stack-timeout", "10m"))
        work.append(subprocess.Popen([sys.executable, "-c", IDLE_SERVER.format(opens=f"f = open({str(fake_gpu)!r})\n")]))

        def all_healthy() -> bool:
            st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
            states = {p["pid"]: (p["state"], p["source"]) for p in st["processes"]}
            # "starting": registered, no first beat yet (the stack-watched server stays so, within startup_grace)
            return (len(states) == 3 and {s for s, _ in states.values()} <= {"healthy", "starting"}
                    and "discovered" in {s for _, s in states.values()})
        wait_for(all_healthy, 30, "the three processes watched, none suspect or hung", every=0.5)
        # Each process's series, as Prometheus stores them: the stack-watched and the discovered ones
        # export a last beat of 0 (never) and the default heartbeat timeout.
        wait_for(lambda: len(prom.query("hangwatchd_last_beat_timestamp_seconds")) == 3, 30, "the three processes scraped")
        never = prom.query("hangwatchd_last_beat_timestamp_seconds == 0")
        assert len(never) == 2, never
        # Every rule evaluated again and again (each second) while they run: nothing pending, nothing firing.
        for _ in range(15):
            assert prom.active() == [], prom.active()
            time.sleep(1.0)
        assert all(p.poll() is None for p in work)
    finally:
        for w in work:
            stop(w)
        prom.stop()
        d.stop()


def test_a_slow_job_fires_its_alert_naming_the_rank_the_cause_and_the_incident(tmp_path: Path) -> None:
    """Three ranks meeting every step at a TCP barrier; once the daemon has the job's pace, rank 1
    does a third of a step more compute each step: GPUJobSlow fires with the rank, its node, the
    cause and the slow incident's id, and stops once the rank is back to its pace."""
    from .test_slow import PACE, Job, baseline, slow_incidents

    d = ScratchDaemon(tmp_path / "d", env={"NODE_NAME": "node-slow"}, config=PACE)
    prom = Prometheus(tmp_path / "prom", [d.info["metrics_address"]])
    job = Job(tmp_path, [d] * 3, "paced", backend="barrier")
    try:
        base = baseline(d, "paced")
        assert prom.firing("GPUJobSlow") == []
        job.set(compute={1: 0.33 * base})
        (alert,) = wait_for(lambda: prom.firing("GPUJobSlow", workload_job="paced"), 150, "GPUJobSlow", every=1.0)
        assert (alert["labels"]["rank"], alert["labels"]["rank_node"], alert["labels"]["cause"]) == ("1", "node-slow", "cpu-bound")
        (inc,) = wait_for(lambda: slow_incidents(d), 30, "the slow incident stored")  # the alert may come first: the episode's gauge is set as it begins
        wait_for(lambda: prom.firing("GPUJobSlow")[0]["annotations"].get("incident"), 20, "the incident id in the annotation")
        assert prom.firing("GPUJobSlow")[0]["annotations"]["incident"] == inc["id"]
        assert prom.firing("GPUProcessHung") == []  # slow is not hung
        job.set()
        wait_for(lambda: prom.firing("GPUJobSlow") == [], 150, "GPUJobSlow to stop once the job is back to its pace", every=1.0)
    finally:
        job.stop()
        prom.stop()
        d.stop()
def test_a_gpu_that_different_jobs_fail_on_fires_gpu_suspect_and_an_applications_xid_fires_no_gpu_alert(tmp_path: Path) -> None:
    """Two jobs each hit their own illegal address (XID 31, named by the kernel log) on GPU 1, then hang:
    their incidents implicate the GPU, and GPUSuspect fires for it, as the ledger's health says; the
    XIDs themselves, an application's faults, fire no GPUXidError."""
    from .gpu_node import MMU_FAULT, Node

    node = Node(tmp_path / "node", env={"NODE_NAME": "node-suspect"})
    prom = Prometheus(tmp_path / "prom", [node.d.info["metrics_address"]])
    try:
        wait_for(lambda: prom.query('hangwatchd_gpu_suspect{gpu="1"}'), 30, "the fresh daemon's GPU series scraped")
        assert prom.firing("GPUSuspect") == []
        first = node.rank("first", gpu=1)
        node.kernel_log(f"NVRM: Xid (PCI:0000:19:00): 31, pid={first.pid}, name=python3, {MMU_FAULT}")
        first.stop_beating()
        node.incident("first")
        # Its implication scraped, then the rules evaluated on it a few times: one job's own faults are the job's.
        wait_for(lambda: prom.query('hangwatchd_gpu_implicating_jobs{gpu="1"} == 1'), 30, "the first job's incident scraped")
        for _ in range(3):
            assert prom.firing("GPUSuspect") == [] and node.health()[0] == 0
            time.sleep(1.0)
        second = node.rank("second", gpu=1)
        node.kernel_log(f"NVRM: Xid (PCI:0000:19:00): 31, pid={second.pid}, name=python3, {MMU_FAULT}")
        second.stop_beating()
        node.incident("second")
        fired = wait_for(lambda: prom.firing("GPUSuspect", Hostname="node-suspect"), 45, "GPUSuspect")
        assert (fired[0]["labels"]["gpu"], fired[0]["labels"]["UUID"]) == ("1", "GPU-fake-1")
        assert node.health()[0] == 1
        assert prom.firing("GPUXidError") == []
    finally:
        prom.stop()
        node.stop()
