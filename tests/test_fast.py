"""Fast where a person waits: the commands import only what they need; evidence is added to an
incident after it is stored; discovery finds a new GPU process within seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.capture import late
from hangwatchd.testing import ScratchDaemon, stop, wait_for

from .conftest import FIXTURES, hangwatchd

# What `hangwatchd symbolize` must never load: the daemon's logging, metrics, store, S3 and config.
NOT_FOR_SYMBOLIZE = ("structlog", "prometheus_client", "boto3", "botocore", "sqlite3", "zstandard",
                     "hangwatchd.incidents", "hangwatchd.incidents.store", "hangwatchd.config", "hangwatchd.metrics",
                     "hangwatchd.daemon", "hangwatchd.host.subproc", "subprocess")


def imported(stderr: str) -> set[str]:
    """The modules a ``python -X importtime`` run imported, from its report on stderr."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("as_json", [True, False])
def test_symbolize_imports_only_the_reader(raw_dumps: dict[str, Path], as_json: bool) -> None:
    dump = raw_dumps["cpp_hang"]
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "hangwatchd", "symbolize",
                          *(["--json"] if as_json else []), str(dump)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    mods = imported(res.stderr)
    assert "hangwatchd.cudacore.symbolize" in mods  # the report is what it claims to be
    assert sorted(m for m in NOT_FOR_SYMBOLIZE if m in mods) == []
    if as_json:
        assert json.loads(res.stdout)["kernels"]
    else:
        assert "kernel" in res.stdout.lower()


def test_help_still_names_the_config_defaults() -> None:
    """The defaults in the help text are filled in when help is printed (the config is not imported before)."""
    out = hangwatchd("daemon", "--help").stdout
    assert "(default: /var/lib/hangwatchd)" in " ".join(out.split())
    assert "{default:" not in out


def test_a_bad_dump_is_still_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.nvcudmp"
    bad.write_bytes(b"not a dump")
    res = hangwatchd("symbolize", str(bad))
    assert res.returncode == 2
    assert res.stderr.startswith("hangwatchd: ") and len(res.stderr.strip().splitlines()) == 1


def test_a_store_error_is_still_exit_1(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "index.sqlite").write_bytes(b"garbage that is not a database" * 100)
    res = hangwatchd("incidents", "--state-dir", str(state), "--runtime-dir", str(tmp_path / "run"))
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("hangwatchd: ") and "Traceback" not in res.stderr


# -- an incident is stored before its slow evidence, which is added as it comes ------------------

def _gpu_rank(d: ScratchDaemon, rank: int, cuda: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29556")
    argv = [sys.executable, "-m", "hangwatchd.testing", "gpu-workload", "--cuda", cuda,
            "--dump", str(FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz")]
    return d.run(argv, "--job", "J", "--heartbeat-timeout", "1", "--rank", str(rank), env=env, start_new_session=True)


def _incident_json(inc: dict[str, Any]) -> dict[str, Any]:
    return json.loads((Path(inc["dir"]) / "incident.json").read_text())


def _steps(data: dict[str, Any], pid: int) -> dict[str, dict[str, Any]]:
    proc = next(p for p in data["processes"] if p["pid"] == pid)
    return {s["step"]: s for s in proc["steps"]}


def test_a_job_incident_is_stored_before_its_dumps_and_a_dump_that_never_comes_holds_nobody_back(tmp_path: Path) -> None:
    config = {"gpu_dump": "always", "pyspy_native": False, "gpu_dump_timeout": 8.0}
    with ScratchDaemon(tmp_path, config=config) as d:
        ranks = [_gpu_rank(d, 0, "dump"), _gpu_rank(d, 1, "ignore")]  # rank 1's driver never writes its dump
        try:
            (inc,) = wait_for(d.store().list, 30, "the incident listed", every=0.02)
            pids = sorted(inc["processes"])
            assert len(pids) == 2
            # Listed while rank 1's dump is still coming (it never will: 8 s), with every rank's stacks in.
            data = _incident_json(inc)
            assert any(p["step"] == "cuda_dump" for p in data["pending"])
            for pid in pids:
                assert _steps(data, pid)["pyspy"]["ok"]
                assert (Path(inc["dir"]) / str(pid) / "pyspy.json").exists()
            assert not list(Path(inc["dir"]).glob("*/.*tmp*"))  # nothing half-written is visible
            shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir)).stdout
            assert "evidence still coming" in shown and "still coming: " in shown
            listed = hangwatchd("incidents", "--state-dir", str(d.state_dir), "--runtime-dir", str(d.runtime_dir)).stdout
            assert "(evidence coming)" in listed

            # Rank 0's dump is added, symbolised, while rank 1's is still pending: nobody waits for rank 1.
            def rank0_dumped() -> dict[str, Any] | None:
                now = _incident_json(inc)
                done = {p["pid"] for p in now["processes"] if "cuda_dump" in _steps(now, p["pid"])}
                return now if len(done) == 1 and now["pending"] else None
            data = wait_for(rank0_dumped, 20, "one rank's dump added while the other's is pending", every=0.05)
            (dumped,) = [p["pid"] for p in data["processes"] if "cuda_dump" in _steps(data, p["pid"])]
            assert _steps(data, dumped)["cuda_dump"]["ok"] and _steps(data, dumped)["flight_recorder"]["ok"]
            sym = json.loads((Path(inc["dir"]) / str(dumped) / "symbolized.json").read_text())
            assert sym["kernels"][0]["name"] == "consumer_kernel(int volatile*, int*)"
            assert {p["pid"] for p in data["pending"]} == {next(p for p in pids if p != dumped)}

            # Rank 1's deadline passes: marked as never come, nothing pending, the index row settled.
            (done,) = wait_for(d.settled, 30, "the incident settled", every=0.2)
            data = _incident_json(done)
            missing = next(p for p in pids if p != dumped)
            step = _steps(data, missing)["cuda_dump"]
            assert not step["ok"] and "no dump appeared" in step["error"]
            assert data["pending"] == [] and "still coming" not in (done["summary"] or "")
            shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir)).stdout
            assert "still coming" not in shown and "no dump appeared" in shown
            assert not list(d.store().dir.glob(".late-*"))
            stored = [e for e in d.logs() if e.get("event") == "incident_stored_first"]
            amended = [e for e in d.logs() if e.get("event") == "incident_amended"]
            whole = [e for e in amended if e["outcome"] != "partial"]
            assert len(stored) == 1 and len(whole) == 4  # a flight recorder and a dump of each rank
            assert stored[0]["seconds"] < min(e["seconds"] for e in amended)
            # The symbolised report went in before the dump was compressed, and only it.
            (early,) = [e for e in amended if e["outcome"] == "partial"]
            assert (early["pid"], early["step"], early["files"]) == (dumped, "cuda_dump", ["symbolized.json"])
            dump_done = next(e for e in whole if e["pid"] == dumped and e["step"] == "cuda_dump")
            assert amended.index(early) < amended.index(dump_done)
            kept = {p.name for p in (Path(inc["dir"]) / str(dumped)).iterdir()}
            assert "coredump.nvcudmp.zst" in kept and "coredump.nvcudmp" not in kept  # the dump kept once, compressed
        finally:
            for r in ranks:
                stop(r)


def _moments(path: Path) -> dict[str, list[float]]:
    """What the fake workload wrote down ('fr-asked', 'fr-written', 'cuda-asked', ...): when, each time."""
    out: dict[str, list[float]] = {}
    for what, t in (line.split() for line in path.read_text().splitlines()):
        out.setdefault(what, []).append(float(t))
    return out


@pytest.mark.parametrize("fr", ["answer", "silent"])
def test_the_flight_recorder_is_asked_with_the_stacks_and_the_gpu_dump_waits_for_its_trace(tmp_path: Path, fr: str) -> None:
    """PyTorch 2.11 writes its trace 3.4-4.4 s after reading its pipe, and the GPU dump ends the
    process: the trace is asked for while the stacks are taken, and the dump waits for it (never
    longer than late.HEAD_START from the request, for a PyTorch that does not answer)."""
    moments = tmp_path / "moments"
    with ScratchDaemon(tmp_path, config={"gpu_dump": "always", "pyspy_native": False}) as d:
        work = d.run([sys.executable, "-m", "hangwatchd.testing", "gpu-workload", "--fr", fr, "--fr-delay", "2.5",
                      "--moments", str(moments), "--dump", str(FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz")],
                     "--heartbeat-timeout", "1", "--rank", "0")
        try:
            (inc,) = wait_for(d.settled, 40, "the incident settled", every=0.1)
            assert work.wait(10) == 134  # its GPU dump ended it
            m = {what: times[-1] for what, times in _moments(moments).items()}  # the hang's, after the warm-up's
            stored = _log_time(next(e for e in d.logs() if e.get("event") == "incident_stored_first"))
            assert m["fr-asked"] < stored  # asked while the first stage ran, not after it
            steps = _steps(_incident_json(inc), inc["processes"][0])
            assert steps["cuda_dump"]["ok"], steps["cuda_dump"]
            if fr == "answer":
                assert m["fr-written"] <= m["cuda-asked"] < m["fr-written"] + 1.5  # the dump waited for the trace, no longer
                assert steps["flight_recorder"]["ok"], steps["flight_recorder"]
                assert (Path(inc["dir"]) / str(inc["processes"][0]) / "flight-recorder.pkl").stat().st_size > 0
            else:
                assert late.HEAD_START - 0.5 < m["cuda-asked"] - m["fr-asked"] < late.HEAD_START + 1.5
                assert "ended (its GPU dump, a crash) before its flight recorder wrote" in steps["flight_recorder"]["error"]
        finally:
            stop(work)


@pytest.mark.parametrize("warmup", [True, False])
def test_the_flight_recorder_asked_as_the_rank_starts_answers_at_the_hang_without_its_first_dump_import(
        tmp_path: Path, warmup: bool) -> None:
    """PyTorch 2.11 imports torch._inductor the first time it dumps a trace with entries (3.4-7 s on
    an H200, eager mode). With flight_recorder_warmup the daemon asks while the rank runs, again
    while the trace is empty (before the first collective), and the hang's trace comes at once;
    without it, the hang's capture waits for that import."""
    first_dump, entries_after = 3.0, 2.5
    moments = tmp_path / "moments"
    config = {"gpu_dump": "never", "pyspy_native": False, "flight_recorder_warmup": warmup}
    with ScratchDaemon(tmp_path, config=config) as d:
        work = d.run([sys.executable, "-m", "hangwatchd.testing", "gpu-workload", "--cuda", "none", "--beats", "200",
                      "--fr-first-delay", str(first_dump), "--fr-entries-after", str(entries_after),
                      "--moments", str(moments)],
                     "--heartbeat-timeout", "1", "--rank", "0", start_new_session=True)
        try:
            (inc,) = wait_for(d.settled, 40, "the incident settled", every=0.1)
            steps = _steps(_incident_json(inc), inc["processes"][0])
            assert steps["flight_recorder"]["ok"], steps["flight_recorder"]
            m = _moments(moments)
            (stopped,) = m["stopped-beating"]
            (imported,) = m["fr-imported"]
            asks, hang_asked, hang_written = m["fr-asked"], m["fr-asked"][-1], m["fr-written"][-1]
            assert stopped < hang_asked
            warmed = [e for e in d.logs() if e.get("event") == "flight_recorder_warmed"]
            if warmup:
                # asked while it ran: before its first collective (an empty trace), again until a trace had entries
                assert m["fr-written-empty"] and len(m["fr-written"]) == 2 and asks[-2] < stopped
                assert imported < asks[-1] and [e["pid"] for e in warmed] == inc["processes"]
                assert hang_written - hang_asked < first_dump / 2
            else:
                assert len(asks) == 1 and not warmed
                assert hang_written - hang_asked >= first_dump  # the hang's capture paid the import
        finally:
            stop(work)


# -- discovery: a new GPU process found within seconds, not at the next rescan ----------------------

def test_a_process_that_opens_the_gpu_is_discovered_within_5_s(tmp_path: Path) -> None:
    """The stand-in device is a regular file whose path the config names (no root needed); the full
    rescan is a minute away, so only the discovery thread can find it in time."""
    device = tmp_path / "nvidia-stand-in0"
    device.write_text("")
    config = {"discover": True, "discover_devices": str(device), "rescan_interval": 60.0, "gpu_dump": "never"}
    code = (f"import sys, time\ntime.sleep(1.5)\nf = open({str(device)!r})\nprint(time.time(), flush=True)\n"
            "time.sleep(120)\n")
    with ScratchDaemon(tmp_path, config=config) as d:
        ignored = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # holds no device
        work = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            assert work.stdout is not None
            opened = float(work.stdout.readline())

            def discovered() -> list[dict[str, Any]]:
                st = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
                return [p for p in st["processes"] if p["pid"] == work.pid]
            (proc,) = wait_for(discovered, 10, "the process discovered", every=0.1)
            assert proc["source"] == "discovered"
            assert any(e.get("event") == "gpu_processes_found" and work.pid in e["pids"] for e in d.logs())
            seen = [e for e in d.logs() if e.get("event") == "process_registered" and e.get("pid") == work.pid]
            assert len(seen) == 1
            lag = _log_time(seen[0]) - opened
            assert lag < 5.0, f"found {lag:.1f} s after it opened the device"
            assert not [p for p in json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
                        ["processes"] if p["pid"] == ignored.pid]
        finally:
            stop(work)
            stop(ignored)


def _log_time(event: dict[str, Any]) -> float:
    """The wall-clock time of a daemon log event (structlog's ISO timestamp)."""
    import datetime

    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def test_evidence_a_stopped_daemon_was_waiting_for_is_marked_as_never_come(tmp_path: Path) -> None:
    """A daemon stopped while a rank's GPU dump was coming: at the next start the incident says so,
    nothing is pending, and what the step had half-written is gone, never shown."""
    from hangwatchd.incidents.store import Store
    from hangwatchd.model import Incident, PendingEvidence, ProcessCapture, StepResult
    from hangwatchd.workload import registration_file

    store = Store(tmp_path)
    store.open()
    reg = registration_file.from_proc(os.getpid())
    assert reg is not None
    pid = reg.process.pid
    draft = store.begin("heartbeat", None, [pid])
    (draft.path / str(pid)).mkdir()
    inc = Incident(draft.id, draft.time, "h", "heartbeat", "no beat", None,
                   processes=(ProcessCapture(reg, (StepResult("pyspy", True, 0.1),)),),
                   pending=(PendingEvidence(pid, "cuda_dump", draft.time + 120),))
    store.commit(draft, inc, "blocked; still coming: cuda_dump of 1 rank")
    assert store.list()[0]["pending"] == 1
    late = store.late_dir(draft.id, pid, "cuda_dump")
    (late / "coredump.nvcudmp.zst").write_bytes(b"half a dump")

    again = Store(tmp_path)  # the next start
    again.open()
    assert draft.id in again.recover()
    (row,) = again.list()
    data = json.loads((Path(row["dir"]) / "incident.json").read_text())
    step = _steps(data, pid)["cuda_dump"]
    assert not step["ok"] and "never came: the daemon stopped" in step["error"]
    assert data["pending"] == [] and row["pending"] == 0 and row["summary"] == "blocked"
    assert not late.exists() and not (Path(row["dir"]) / str(pid) / "coredump.nvcudmp.zst").exists()
    shown = hangwatchd("show", draft.id, "--state-dir", str(tmp_path), "--runtime-dir", str(tmp_path / "run")).stdout
    assert "never came" in shown and "still coming" not in shown
