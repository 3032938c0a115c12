"""Acting after capture: on_hang = "abort" ends a hung job's ranks once its incident is stored; "report" never kills."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

from .conftest import needs_root
from .s3server import S3Server

TIMEOUT = 1.0
FAST = {"pyspy_native": False, "gpu_dump": "never", "capture_steps": ["proc", "pyspy"]}
# A workload that stops beating and ignores SIGABRT: only SIGKILL ends it.
STUBBORN = """
import signal, threading, time, hangwatchd
signal.signal(signal.SIGABRT, signal.SIG_IGN)
for _ in range(5):
    hangwatchd.beat(); time.sleep(0.05)
print("stopped beating", flush=True)
threading.Event().wait()
"""


def events(d: ScratchDaemon, name: str) -> list[dict]:
    return [e for e in d.logs() if e.get("event") == name]


def test_abort_ends_the_hung_job_after_its_incident_is_stored_and_says_which(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config=FAST) as d:
        work = d.run(workload_argv(beats=5), "--job", "train", "--heartbeat-timeout", str(TIMEOUT), "--on-hang", "abort",
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert work.stdout is not None and work.stdout.readline().strip() == b"stopped beating"
            hung_at = time.monotonic()
            out, err = work.communicate(timeout=TIMEOUT + 60 + 5)
            over_after = time.monotonic() - hung_at
        finally:
            stop(work)
        (inc,) = d.store().list()
        # The evidence was taken from the live process, before it was ended.
        assert inc["reason"] == "heartbeat" and inc["complete"]
        pyspy = json.loads(next(Path(inc["dir"]).rglob("pyspy.json")).read_text())
        assert "hang_here" in json.dumps(pyspy)
        stored_at = next(e for e in events(d, "incident_stored"))["timestamp"]
        aborted = events(d, "job_aborted")
        assert len(aborted) == 1 and aborted[0]["incident"] == inc["id"] and aborted[0]["timestamp"] >= stored_at
        # Over within timeout + capture + 5 s of its last beat, ended by SIGABRT (a Python process's default: it dies at once).
        capture_s = next(e for e in events(d, "incident_stored"))["seconds"]
        assert over_after < TIMEOUT + capture_s + 5, (over_after, capture_s)
        assert work.returncode == 128 + signal.SIGABRT
        assert f"ended by the daemon after incident {inc['id']}" in err.decode()
        (pid,) = inc["processes"]
        (record,) = [json.loads(p.read_text()) for p in (d.runtime_dir / "exits").glob(f"{pid}-*.json")]
        assert record["signal"] == signal.SIGABRT and record["ended_by"] == {"daemon": True, "incident": inc["id"]}
        assert d.metric("hangwatchd_jobs_aborted_total") == 1.0


def test_a_rank_that_ignores_sigabrt_is_killed_after_the_grace(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config={**FAST, "on_hang": "abort", "abort_grace": 1.0}) as d:  # root's config, no flag
        work = d.run([sys.executable, "-c", STUBBORN], "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
        try:
            assert work.stdout is not None and work.stdout.readline().strip() == b"stopped beating"
            assert work.wait(timeout=TIMEOUT + 60 + 5) == 128 + signal.SIGKILL
        finally:
            stop(work)
        (inc,) = d.store().list()
        (over,) = events(d, "abort_grace_over")
        (aborted,) = events(d, "job_aborted")
        assert over["pid"] == inc["processes"][0] and aborted["incident"] == inc["id"]


def test_report_leaves_the_hung_job_running(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config={**FAST, "abort_grace": 1.0}) as d:  # on_hang defaults to report
        work = d.run(workload_argv(beats=5), "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
        # The job's own choice wins over root's abort: this one asked for report.
        d2 = None
        try:
            (inc,) = wait_for(d.store().list, 30, "the incident")
            wait_for(lambda: events(d, "incident_stored"), 10, "the incident logged (acting follows it at once)")
            (pid,) = inc["processes"]
            # The policy decided: nothing signalled, so no SIGKILL is waiting for the grace either.
            assert d.event("hang_acted", incident=inc["id"])["action"] == "report"
            assert work.poll() is None and Path(f"/proc/{pid}").exists()
            assert events(d, "job_aborted") == [] and d.metric("hangwatchd_jobs_aborted_total") == 0.0
        finally:
            stop(work)
        d2 = ScratchDaemon(tmp_path / "abort-config", config={**FAST, "on_hang": "abort", "abort_grace": 1.0})
        try:
            mine = d2.run(workload_argv(beats=5), "--heartbeat-timeout", str(TIMEOUT), "--on-hang", "report", stdout=subprocess.PIPE)
            try:
                wait_for(lambda: events(d2, "incident_stored"), 30, "the incident")
                assert d2.event("hang_acted")["action"] == "report"  # the job's own report wins over root's abort
                assert mine.poll() is None and events(d2, "job_aborted") == []
            finally:
                stop(mine)
        finally:
            d2.stop()


# A process of another user that registers itself by hand in a job of the same name, asking for abort.
OTHER_USER = """
import json, os, sys, time
pid = os.getpid()
start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
reg = {"pid": pid, "start_time": start, "job": "train", "on_hang": "abort", "stack_timeout": 3600,
       "registered_at": time.time(), "version": 1}
path = f"{sys.argv[1]}/registrations/{pid}-{start}.json"
with open(path + ".tmp", "w") as f:
    json.dump(reg, f)
os.rename(path + ".tmp", path)
print("registered", flush=True)
time.sleep(600)
"""


@needs_root
def test_abort_never_ends_another_users_process_in_a_job_of_the_same_name() -> None:
    base = Path(tempfile.mkdtemp(prefix="hw-act-"))
    os.chmod(base, 0o755)
    try:
        with ScratchDaemon(base, config=FAST) as d:
            os.chmod(d.runtime_dir, 0o755)
            other = subprocess.Popen(["/usr/bin/python3", "-c", OTHER_USER, str(d.runtime_dir)], user="nobody", group="nogroup",
                                     extra_groups=[], cwd="/", stdout=subprocess.PIPE)
            try:
                assert other.stdout is not None and other.stdout.readline().strip() == b"registered"
                wait_for(lambda: any(e.get("pid") == other.pid for e in events(d, "process_registered")) or
                         str(other.pid) in (d.runtime_dir / "status.json").read_text(), 10, "nobody's process watched")
                mine = d.run(workload_argv(beats=5), "--job", "train", "--heartbeat-timeout", str(TIMEOUT), "--on-hang", "abort",
                             stdout=subprocess.PIPE)
                try:
                    assert mine.wait(timeout=60) == 128 + signal.SIGABRT
                finally:
                    stop(mine)
                (aborted,) = events(d, "job_aborted")
                assert other.poll() is None and other.pid not in aborted["pids"] and len(aborted["pids"]) == 1
            finally:
                stop(other)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- across nodes: the capture request carries the action ----------------------

RANK = """
import sys, threading, time, hangwatchd
for _ in range(10):
    hangwatchd.beat(); time.sleep(0.05)
print("running", flush=True)
if sys.argv[1] == "stuck":
    threading.Event().wait()
while True:
    hangwatchd.beat(); time.sleep(0.1)
"""


def test_abort_ends_the_jobs_ranks_on_every_node_after_each_nodes_capture(tmp_path: Path, s3: S3Server) -> None:
    cfg = {**FAST, "store_poll_interval": 0.5, "abort_on_request": True}  # root lets the store's word end ranks
    with ScratchDaemon(tmp_path / "a", "--store", s3.url(), "--node-name", "node-a", env=s3.env, config=cfg) as a, \
         ScratchDaemon(tmp_path / "b", "--store", s3.url(), "--node-name", "node-b", env=s3.env, config=cfg) as b:
        r0 = a.run([sys.executable, "-c", RANK, "stuck"], "--job", "j", "--rank", "0", "--heartbeat-timeout", "2",
                   "--on-hang", "abort", stdout=subprocess.PIPE)
        r1 = b.run([sys.executable, "-c", RANK, "beating"], "--job", "j", "--rank", "1", "--heartbeat-timeout", "2",
                   "--on-hang", "abort", stdout=subprocess.PIPE)
        try:
            assert r0.wait(timeout=60) == 128 + signal.SIGABRT
            assert r1.wait(timeout=30) == 128 + signal.SIGABRT  # healthy-looking here, but its job hung
        finally:
            stop(r0, r1)
        (inc_b,) = b.store().list()
        assert inc_b["reason"] == "job-request"
        (ab,) = events(b, "job_aborted")
        assert ab["incident"] == inc_b["id"] and ab["timestamp"] >= events(b, "incident_stored")[0]["timestamp"]


# -- GPU faults: NVML's XID events, the verdict, the node's health ---------------

FAKE_NVML = Path(__file__).parent / "fake_nvml"


def fake_nvml_module(directory: Path) -> Any:
    """tests/fake_nvml/pynvml.py as a module object: NVML's API over files in ``directory``."""
    import importlib.util

    os.environ["HANGWATCHD_FAKE_NVML"] = str(directory)
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKE_NVML / "pynvml.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def nvml_dir(base: Path, gpus: int = 4) -> Path:
    d = base / "nvml"
    (d / "events").mkdir(parents=True)
    (d / "gpus").write_text(str(gpus))
    return d


def xid(directory: Path, **event: int) -> None:
    n = len(list((directory / "events").iterdir())) + int(time.time() * 1000)
    tmp = directory / f".{n}.tmp"
    tmp.write_text(json.dumps(event))
    tmp.replace(directory / "events" / f"{n}.json")


def nvml_env(directory: Path) -> dict[str, str]:
    return {"HANGWATCHD_FAKE_NVML": str(directory),
            "PYTHONPATH": os.pathsep.join(p for p in (str(FAKE_NVML), os.environ.get("PYTHONPATH", "")) if p)}


def test_the_listener_records_nvml_xid_events_on_its_own_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hangwatchd.host.gpu_events import GpuEvent, GpusFound, Listener, Recorder

    monkeypatch.setenv("HANGWATCHD_FAKE_NVML", "")
    d = nvml_dir(tmp_path)
    nv = fake_nvml_module(d)
    posted: list[object] = []
    rec = Recorder(limit=3)
    listener = Listener(rec, posted.append, nvml=nv, wait_ms=200)
    listener.start()
    seen: list[GpuEvent] = []
    try:
        assert listener.ready.wait(10)
        (found,) = posted
        assert isinstance(found, GpusFound) and found.gpus == (0, 1, 2, 3)
        # Each GPU as the kernel log and an RMA name it too: its PCI address and its board's serial.
        assert [(g.index, g.uuid, g.serial, g.pci) for g in found.infos][3] == (3, "GPU-fake-3", "1650000003", "0000:1b:00")
        before = time.time()
        for gpu, code, recovery in ((1, 13, None), (3, 79, None), (0, 48, None), (3, 31, None), (2, 94, 1)):
            xid(d, gpu=gpu, xid=code, **({"recovery": recovery} if recovery is not None else {}))
            wait_for(lambda: not list((d / "events").iterdir()), 10, "the event taken")
        xid(d, lost=2)
        wait_for(lambda: len(posted) == 7, 10, "six events")
        seen = [e for e in posted if isinstance(e, GpuEvent)]
    finally:
        listener.stop()
        listener.join(5)
    assert not listener.is_alive()  # it looks at its stop flag between waits: the daemon's stop is never held up
    assert [(e.gpu, e.xid, e.lost) for e in seen] == [(1, 13, False), (3, 79, False), (0, 48, False), (3, 31, False),
                                                      (2, 94, False), (2, 0, True)]
    assert all(e.time >= before for e in seen) and seen[1].uuid == "GPU-fake-3" and seen[1].what == "fell off the bus"
    assert seen[1].pci == "0000:1b:00" and seen[1].serial == "1650000003"
    # 13 and 31 are a job's own errors; 94 (a contained ECC error) is not one the catalogue resets the GPU
    # for, but NVML reported a GPU reset as its recovery action: the node's fault then.
    assert [e.kind for e in seen] == ["application", "gpu", "gpu", "application", "gpu", "gpu"]
    assert [e.node_fault for e in seen] == [False, True, True, False, True, True]
    assert seen[4].recovery == 1 and seen[4].to_json()["recovery_action"] == "GPU reset" and seen[0].recovery == 0
    assert [(e.gpu, e.xid) for e in rec.events()] == [(3, 31), (2, 94), (2, 0)]  # bounded: the newest kept


def test_without_nvml_the_listener_says_why_and_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hangwatchd.host.gpu_events import Listener, Recorder

    monkeypatch.setenv("HANGWATCHD_FAKE_NVML", "")
    nv = fake_nvml_module(tmp_path)
    monkeypatch.setenv("HANGWATCHD_FAKE_NVML", "")  # no library: what a node without a driver answers
    rec = Recorder()
    listener = Listener(rec, lambda _m: None, nvml=nv)
    listener.start()
    listener.join(10)
    assert not listener.is_alive() and rec.unavailable and "NVML is not available" in rec.unavailable


def hand_made_incident(base: Path, offset: float, xid_code: int = 79, gpu: int = 3) -> Path:
    inc = base / "by-hand"
    pdir = inc / "4174"
    pdir.mkdir(parents=True)
    stopped = 1_764_000_000.0
    (inc / "incident.json").write_text(json.dumps({"id": "x", "reason": "heartbeat", "since": stopped,
                                                    "processes": [{"pid": 4174, "rank": 3}]}))
    (pdir / "proc.json").write_text(json.dumps({"pid": 4174, "rank": 3, "job": "train", "state": "S (sleeping)"}))
    (pdir / "pyspy.json").write_text(json.dumps([{"thread_name": "MainThread", "frames": [
        {"name": "synchronize", "filename": "/usr/lib/python3/site-packages/torch/cuda/__init__.py", "line": 800},
        {"name": "train_step", "filename": "/home/u/train.py", "line": 42}]}]))
    (pdir / "gpu-events.json").write_text(json.dumps({"pid": 4174, "gpus": [gpu], "stopped": stopped, "events": [
        {"time": stopped + offset, "gpu": gpu, "xid": xid_code, "what": "fell off the bus" if xid_code == 79 else "graphics engine exception",
         "needs_reset": xid_code == 79, "lost": False}]}))
    return inc


def test_the_verdict_says_when_a_gpu_fault_explains_the_hang(tmp_path: Path) -> None:
    from .conftest import hangwatchd

    inc = hand_made_incident(tmp_path / "near", -2.0)
    res = hangwatchd("analyze", str(inc), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)["summary"]
    assert summary.startswith("GPU 3 reported XID 79 (fell off the bus) 2 s before rank 3 stopped"), summary
    text = hangwatchd("analyze", str(inc)).stdout
    assert "GPU 3 reported XID 79 (fell off the bus) 2 s before rank 3 stopped" in text
    # An XID long before the stop is not its cause: the verdict is the program's.
    far = hand_made_incident(tmp_path / "far", -3 * 3600.0)
    assert "XID" not in json.loads(hangwatchd("analyze", str(far), "--json").stdout)["summary"]


def health(d: ScratchDaemon | Path, *extra: str) -> tuple[int, str]:
    runtime_dir = d.runtime_dir if isinstance(d, ScratchDaemon) else d
    res = subprocess.run([sys.executable, "-m", "hangwatchd", "health", "--runtime-dir", str(runtime_dir), *extra],
                         capture_output=True, text=True, timeout=60)
    lines = res.stdout.splitlines()
    assert len(lines) == 1, res.stdout + res.stderr  # NPD's contract: one line on stdout
    return res.returncode, lines[0]


def test_health_speaks_of_the_node_never_of_a_jobs_hang(tmp_path: Path) -> None:
    # Not running: the node cannot be watched.
    code, line = health(tmp_path / "nothing-here")
    assert code == 1 and "not running" in line
    d = nvml_dir(tmp_path)
    with ScratchDaemon(tmp_path / "hw", env=nvml_env(d), config=FAST) as daemon:
        wait_for(lambda: daemon.metric("hangwatchd_gpu_xid_errors_total", gpu="3", xid="79") == 0.0, 10,
                 "the GPUs found, their XID series at 0")
        code, line = health(daemon)
        assert code == 0 and "4 GPUs without faults" in line, line
        # A job's own hang, captured: still the node is fine.
        work = daemon.run(workload_argv(beats=5), "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
        try:
            wait_for(daemon.store().list, 30, "the job's incident")
            wait_for(lambda: "hung process" in health(daemon)[1], 10, "the captured hang in the status")
            code, line = health(daemon)
            assert code == 0 and "not a node fault" in line, line
        finally:
            stop(work)
        # A job's own GPU error (XID 13): counted, never a node condition.
        xid(d, gpu=1, xid=13)
        wait_for(lambda: daemon.metric("hangwatchd_gpu_xid_errors_total", gpu="1", xid="13") == 1.0, 10, "XID 13 counted")
        assert health(daemon)[0] == 0
        # A GPU that fell off the bus: the node is at fault.
        xid(d, gpu=3, xid=79)
        wait_for(lambda: daemon.metric("hangwatchd_gpu_xid_errors_total", gpu="3", xid="79") == 1.0, 10, "XID 79 counted")
        code, line = health(daemon)
        assert code == 1 and "GPU 3 reported XID 79 (fell off the bus)" in line and "reset" in line, line
        # A GPU that stops answering NVML at all: lost, the node's fault too.
        xid(d, lost=2)
        wait_for(lambda: "GPU 2 is lost" in health(daemon)[1], 10, "the lost GPU in the health line")
        assert health(daemon)[0] == 1
        # The loop stalled (SIGSTOP): it cannot watch.
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            def stalled() -> tuple[int, str] | None:
                got = health(daemon, "--stalled-after", "3")
                return got if got[0] == 1 and "loop" in got[1] else None

            code, line = wait_for(stalled, 20, "the stall seen")
            assert "has not run for" in line
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        # A health file nobody can read: unknown, never a verdict on the node.
        (daemon.runtime_dir / "health.json").write_text("{not json")
        assert health(daemon)[0] == 3
    # py-spy unusable: hangs would go without stacks.
    with ScratchDaemon(tmp_path / "no-pyspy", env={"HANGWATCHD_PYSPY": "none"}, config=FAST) as daemon:
        code, line = health(daemon)
        assert code == 1 and "py-spy" in line, line


@needs_root
def test_an_xid_on_a_hung_ranks_gpu_is_in_its_incident_and_its_verdict(tmp_path: Path) -> None:
    device = Path("/dev/nvidia3")
    made = not device.exists()
    if made:
        device.write_text("")  # a file named like GPU 3's device node: holding it open is how a CUDA process shows its GPU
    d = nvml_dir(tmp_path)
    try:
        with ScratchDaemon(tmp_path / "hw", env=nvml_env(d), config=FAST) as daemon:
            wait_for(lambda: daemon.metric("hangwatchd_gpu_xid_errors_total", gpu="3", xid="79") == 0.0, 10, "GPUs found")
            code = ("import threading, time, hangwatchd\nf = open('/dev/nvidia3')\n"
                    "for _ in range(10): hangwatchd.beat(); time.sleep(0.05)\n"
                    "print('stopped', flush=True)\nthreading.Event().wait()\n")
            work = daemon.run([sys.executable, "-c", code], "--rank", "3", "--heartbeat-timeout", "2", stdout=subprocess.PIPE)
            try:
                assert work.stdout is not None and work.stdout.readline().strip() == b"stopped"
                xid(d, gpu=3, xid=79)
                xid(d, gpu=1, xid=13)  # another GPU's: not this process's
                (inc,) = wait_for(daemon.store().list, 30, "the incident")
            finally:
                stop(work)
            (events_file,) = Path(inc["dir"]).rglob("gpu-events.json")
            data = json.loads(events_file.read_text())
            assert data["gpus"] == [3] and [(e["gpu"], e["xid"], e["what"]) for e in data["events"]] == [(3, 79, "fell off the bus")]
            assert "GPU 3 reported XID 79 (fell off the bus)" in inc["summary"] and "rank 3 stopped" in inc["summary"]
    finally:
        if made:
            device.unlink()


def test_the_node_problem_detector_plugin_calls_hangwatchd_health(tmp_path: Path) -> None:
    import yaml

    doc = yaml.safe_load((Path(__file__).parent.parent / "deploy" / "kubernetes" / "node-problem-detector.yaml").read_text())
    monitor = json.loads(doc["data"]["hangwatchd-health.json"])
    assert monitor["plugin"] == "custom"
    (rule,) = monitor["rules"]
    assert rule["type"] == "permanent" and rule["condition"] in {c["type"] for c in monitor["conditions"]}
    assert Path(rule["path"]).name == "hangwatchd" and rule["args"][0] == "health"
    # The rule's own arguments, run as NPD runs them (with this runtime dir): one line, NPD's exit codes.
    args = [a if a != "/run/hangwatchd" else str(tmp_path / "run") for a in rule["args"]]
    res = subprocess.run([sys.executable, "-m", "hangwatchd", *args], capture_output=True, text=True, timeout=10)
    assert res.returncode == 1 and len(res.stdout.splitlines()) == 1 and "not running" in res.stdout
    with ScratchDaemon(tmp_path, config=FAST) as d:
        wait_for(lambda: (d.runtime_dir / "health.json").exists(), 10, "the health file")
        res = subprocess.run([sys.executable, "-m", "hangwatchd", *args], capture_output=True, text=True, timeout=10)
        assert res.returncode == 0 and len(res.stdout.splitlines()) == 1, res.stdout
        assert len(res.stdout) <= monitor["pluginConfig"]["max_output_length"]


def test_a_daemon_stopped_during_the_grace_ends_the_job_now_not_never(tmp_path: Path) -> None:
    d = ScratchDaemon(tmp_path, config={**FAST, "on_hang": "abort", "abort_grace": 3600.0})
    work = d.run([sys.executable, "-c", STUBBORN], "--heartbeat-timeout", str(TIMEOUT), stdout=subprocess.PIPE)
    try:
        wait_for(lambda: events(d, "job_aborted"), 30, "the SIGABRT, which it ignores")
        assert work.poll() is None
        assert d.stop() == 0
        assert work.wait(timeout=10) == 128 + signal.SIGKILL
    finally:
        stop(work)
        d.stop()
