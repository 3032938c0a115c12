"""Verdicts and the rank that diverged, from real captures and hand-written flight-recorder records."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatchd.analyze.verdict import analyze
from hangwatchd.cudacore.symbolize import symbolize
from hangwatchd.host.deadline import Deadline
from hangwatchd.testing import ScratchDaemon, stop, wait_for

from .conftest import FIXTURES, extract, hangwatchd


def fr(last: int, entries: list[tuple[int, str, list[list[int]]]], state_of_last: str = "started") -> dict:
    return {
        "version": "2.4",
        "pg_status": {"0": {"last_enqueued_collective": last, "last_started_collective": last,
                            "last_completed_collective": last if state_of_last == "completed" else last - 1}},
        "entries": [{"record_id": i, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
                     "profiling_name": f"nccl:{name}", "input_sizes": sizes, "input_dtypes": ["Float"],
                     "output_sizes": sizes, "state": state_of_last if seq == last else "completed",
                     "is_p2p": False, "frames": [{"name": "train_step", "filename": "train.py", "line": 40}]}
                    for i, (seq, name, sizes) in enumerate(entries)],
    }


RANK_CODE = """
import os, threading, time, hangwatchd
for _ in range(10): hangwatchd.beat(); time.sleep(0.05)
def all_gather_features():
    threading.Event().wait()      # rank 0: inside the collective, waiting for its peer
def evaluate_on_rank_1():
    threading.Event().wait()      # rank 1: took another branch
(all_gather_features if os.environ["RANK"] == "0" else evaluate_on_rank_1)()
"""


def test_a_diverged_two_rank_job_names_the_rank_that_never_entered_the_collective(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config={"gpu_dump": "never", "pyspy_native": False}) as d:
        ranks = []
        for r in (0, 1):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
            ranks.append(d.run([sys.executable, "-c", RANK_CODE], "--heartbeat-timeout", "1" if r == 0 else "60", env=env))
        try:
            (inc,) = wait_for(d.settled, 20, "one incident for the job")
            assert inc["job"] == "10.0.0.1:29500" and len(inc["processes"]) == 2  # both ranks, one incident
        finally:
            stop(*ranks, sig=signal.SIGKILL)
    incident = Path(inc["dir"])
    by_rank = {json.loads((p / "proc.json").read_text())["rank"]: p for p in incident.iterdir() if (p / "proc.json").exists()}
    (by_rank[0] / "flight-recorder.pkl").write_bytes(pickle.dumps(fr(3, [(2, "all_reduce", [[4]]), (3, "all_gather", [[8, 16]])])))
    (by_rank[1] / "flight-recorder.pkl").write_bytes(pickle.dumps(fr(2, [(2, "all_reduce", [[4]])], "completed")))
    res = hangwatchd("analyze", str(incident), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["summary"].startswith("Rank 1 never entered all_gather #3 (process group 0)")
    (culprit,) = out["culprits"]
    assert culprit["rank"] == 1 and "evaluate_on_rank_1" in culprit["location"] and ":7)" in culprit["location"]
    assert {c["seq"]: (c["ranks_entered"], c["ranks_missing"]) for c in out["collectives"]}[3] == ([0], [1])
    verdicts = {r["rank"]: r["verdict"] for r in out["ranks"]}
    # rank 1 sits in threading.Event.wait: one catalogue tells the detector and the verdict it waits on an event
    assert verdicts == {0: "in-collective", 1: "nobody"}  # rank 1 waits for an event no thread of it can set
    shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir)).stdout
    assert shown.splitlines()[0] == out["summary"]  # show leads with it


def test_a_size_mismatch_between_ranks_is_flagged(tmp_path: Path) -> None:
    for r, sizes in ((0, [[8, 16]]), (1, [[8, 32]])):
        pdir = tmp_path / str(100 + r)
        pdir.mkdir()
        (pdir / "proc.json").write_text(json.dumps({"pid": 100 + r, "rank": r}))
        (pdir / "flight-recorder.pkl").write_bytes(pickle.dumps(fr(5, [(5, "all_gather", sizes)])))
    out = analyze(tmp_path).to_dict()
    assert "disagree on all_gather #5" in out["summary"] and "different sizes" in out["summary"]


def test_every_rank_waiting_in_the_same_collective_points_outside(tmp_path: Path) -> None:
    for r in (0, 1, 2):
        pdir = tmp_path / str(200 + r)
        pdir.mkdir()
        (pdir / "proc.json").write_text(json.dumps({"pid": 200 + r, "rank": r}))
        (pdir / "flight-recorder.pkl").write_bytes(pickle.dumps(fr(9, [(9, "all_reduce", [[1024]])])))
    out = analyze(tmp_path).to_dict()
    assert "Every rank here waits in the same collective (all_reduce)" in out["summary"]
    assert "another node" in out["summary"]


def test_a_hostile_pickle_is_refused_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    pdir = tmp_path / "300"
    pdir.mkdir()
    (pdir / "flight-recorder.pkl").write_bytes(pickle.dumps({"pg_status": {}, "entries": [Evil()]}))
    (pdir / "proc.json").write_text(json.dumps({"pid": 300, "rank": 0}))
    analyze(tmp_path)
    assert not marker.exists()


def test_single_process_verdicts_from_real_captures(tmp_path: Path) -> None:
    gpu = tmp_path / "1"
    gpu.mkdir()
    shutil.copy(FIXTURES / "triton_hang" / "pyspy-native.json", gpu)
    spin = tmp_path / "2"
    spin.mkdir()
    (spin / "symbolized.json").write_text(json.dumps(symbolize(FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz").to_dict()))
    fault = tmp_path / "3"
    fault.mkdir()
    (fault / "symbolized.json").write_text(json.dumps(symbolize(FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").to_dict()))
    locked = tmp_path / "4"
    locked.mkdir()
    p = subprocess.Popen([sys.executable, "-c", "import threading\nl = threading.Lock(); l.acquire()\ndef stuck():\n    l.acquire()\nstuck()"])
    try:
        import time

        time.sleep(0.5)
        res = subprocess.run([sys.executable, "-m", "hangwatchd", "capture", str(p.pid), "--json", "--state-dir", str(tmp_path / "s")],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        src = next((tmp_path / "s" / "incidents").iterdir()) / str(p.pid)
        for f in src.iterdir():
            shutil.copy(f, locked)
    finally:
        stop(p, sig=signal.SIGKILL)
    v = {r["pid"]: r for r in analyze(tmp_path).to_dict()["ranks"]}
    assert v[1]["verdict"] == "waiting-on-gpu" and "cuStreamSynchronize" in v[1]["detail"]
    assert v[1]["location"] == "main (/srv/gpuapp/conditional_hang.py:34)"
    assert v[2]["verdict"] == "gpu-kernel-spinning" and "consumer_kernel" in v[2]["detail"]
    assert "inlined.cu:21" in v[2]["location"]
    assert v[3]["verdict"] == "gpu-exception" and "WARP_ILLEGAL_ADDRESS" in v[3]["detail"] and "inlined.cu:9" in v[3]["location"]
    assert v[p.pid]["verdict"] == "lock-wait" and "stuck" in v[p.pid]["location"]


def test_analyze_refuses_what_is_not_a_directory(tmp_path: Path) -> None:
    res = hangwatchd("analyze", str(tmp_path / "nope"))
    assert res.returncode == 2 and "not a directory" in res.stderr


def test_the_html_page_renders_in_a_real_headless_browser(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path / "d") as d:
        blob = __import__("lzma").decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes())
        (d.dump_dir / f"core_{__import__('socket').gethostname()}.77.1.nvcudmp").write_bytes(blob)
        (inc,) = wait_for(d.settled, 20, "an incident")
    page = tmp_path / "report.html"
    res = hangwatchd("show", inc["id"], "--html", str(page), "--state-dir", str(d.state_dir))
    assert res.returncode == 0 and res.stdout.strip() == str(page), res.stderr
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text  # self-contained
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(browser + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="summary"' in dom.stdout and "WARP_ILLEGAL_ADDRESS" in dom.stdout
    assert "store_at(int*, long, int) (/srv/gpuapp/inlined.cu:9)" in dom.stdout
    shot = tmp_path / "page.png"
    subprocess.run(browser + [f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


def test_the_real_diverged_job_from_an_h200_names_rank_1(tmp_path: Path) -> None:
    extract(FIXTURES.parent / "h200-diverged" / "incident.tar.xz", tmp_path)
    res = hangwatchd("analyze", str(tmp_path / "diverged-incident"), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["summary"].startswith("Rank 1 never entered all_gather #21 (process group 0) that rank 0 waits in")
    (culprit,) = out["culprits"]
    assert culprit["rank"] == 1 and culprit["location"].startswith("evaluate_only_on_rank_1 (") and culprit["location"].endswith("diverge.py:26)")
    verdicts = {r["rank"]: r for r in out["ranks"]}
    assert verdicts[0]["verdict"] == "in-collective" and "ncclDevKernel_AllGather" in verdicts[0]["detail"]
    assert verdicts[1]["last_collective"] == ["0", 20]
    text = hangwatchd("analyze", str(tmp_path / "diverged-incident")).stdout
    assert text.splitlines()[0] == out["summary"]


def test_the_real_size_mismatch_from_an_h200_is_flagged(tmp_path: Path) -> None:
    extract(FIXTURES.parent / "h200-size-mismatch" / "incident.tar.xz", tmp_path)
    out = analyze(tmp_path / "diverged-incident").to_dict()
    assert out["summary"] == ("Ranks disagree on _all_gather_base #21 (process group 0): "
                              "different sizes: rank 0 [[1024]], rank 1 [[2048]].")
    assert {c["rank"] for c in out["culprits"]} == {0, 1}


def stream_incident(tmp_path: Path, process_gpus: list[int], utilisation: int | None, dump: bool = True) -> Path:
    """The real hung triton job's native stack (host in cuStreamSynchronize) with the real dump and NVML facts."""
    pdir = tmp_path / "1110"
    pdir.mkdir(parents=True)
    (pdir / "proc.json").write_text(json.dumps({"pid": 1110}))
    shutil.copy(FIXTURES / "triton_hang" / "pyspy-native.json", pdir)
    if dump:  # the dump's only kernel runs on GPU 0
        (pdir / "symbolized.json").write_text(json.dumps(symbolize(FIXTURES / "triton_hang" / "coredump.nvcudmp.xz").to_dict()))
    devices = [{"index": i, "utilization_percent": utilisation if i in process_gpus else 100} for i in (0, 1)]
    (pdir / "nvml.json").write_text(json.dumps({"devices": devices, "process_gpus": process_gpus}))
    return pdir


def test_a_host_blocked_in_the_driver_while_its_gpu_runs_nothing_is_a_stream_deadlock(tmp_path: Path) -> None:
    stream_incident(tmp_path, [1], 0)  # the process's GPU is 1: the dump shows nothing running there
    out = json.loads(hangwatchd("analyze", str(tmp_path), "--json").stdout)
    (v,) = out["ranks"]
    assert v["verdict"] == "stream-deadlock"
    assert "host blocked in cuStreamSynchronize while the GPU dump shows no kernel running on GPU 1" in v["detail"]
    assert "cudaStreamWaitValue" in v["detail"] and "graph" in v["detail"]
    assert v["location"] == "main (/srv/gpuapp/conditional_hang.py:34)"
    assert out["summary"].startswith("pid 1110: host blocked in cuStreamSynchronize") and "rank None" not in out["summary"]
    text = hangwatchd("analyze", str(tmp_path)).stdout
    assert "  pid 1110: stream-deadlock" in text and "rank None" not in text


def test_nvml_at_zero_percent_without_a_dump_is_a_stream_deadlock_too(tmp_path: Path) -> None:
    stream_incident(tmp_path, [0], 0, dump=False)
    (v,) = analyze(tmp_path).ranks
    assert v.verdict == "stream-deadlock" and "NVML reads 0 % on GPU 0" in v.detail


def test_the_spinning_kernel_and_unknown_utilisation_keep_their_verdicts(tmp_path: Path) -> None:
    stream_incident(tmp_path / "a", [0], 100)  # the real case: its kernel spins on GPU 0
    (v,) = analyze(tmp_path / "a").ranks
    assert v.verdict == "gpu-kernel-spinning" and "conditional_hang_kernel" in v.detail and "GPU 100% busy" in v.detail
    stream_incident(tmp_path / "b", [0], None, dump=False)  # NVML could not say: no claim either way
    (v,) = analyze(tmp_path / "b").ranks
    assert v.verdict == "waiting-on-gpu" and "cuStreamSynchronize" in v.detail


def test_analyze_on_a_directory_that_is_no_incident_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    res = hangwatchd("analyze", str(tmp_path))
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1 and "is no incident" in res.stderr


BAD_FILES = {
    "pyspy-native.json": [b"\xff\xfe", b"[1, 2, {\"frames\": 7}]", b"{\"frames\": []}", b"[{\"frames\": [{\"name\": 5, \"line\": \"x\"}]}]"],
    "flight-recorder.pkl": [pickle.dumps({"pg_status": {"0": {"last_enqueued_collective": "x"}}, "entries": [{"frames": [{"line": "7a"}]}]}),
                            pickle.dumps({"pg_status": [1, 2], "entries": 5}), b"\x80\x05garbage"],
    "nvml.json": [json.dumps({"devices": [{"index": 0, "utilization_percent": None}], "process_gpus": [0]}).encode(), b"[]"],
    "symbolized.json": [b"{\"exceptions\": [{}], \"kernels\": 3}", b"{\"kernels\": [{\"name\": \"k\", \"device\": 0}], \"pcs\": [7]}"],
    "proc.json": [b"{\"rank\": \"zero\", \"pid\": [1]}", b"null"],
}


def test_each_unreadable_piece_of_evidence_is_a_line_and_the_verdict_says_what_it_rests_on(tmp_path: Path) -> None:
    for i, (name, variants) in enumerate(BAD_FILES.items()):
        for j, content in enumerate(variants):
            pdir = tmp_path / f"{i}{j}"
            pdir.mkdir()
            (pdir / name).write_bytes(content)
            if name != "pyspy-native.json":
                shutil.copy(FIXTURES / "triton_hang" / "pyspy-native.json", pdir)
    res = hangwatchd("analyze", str(tmp_path), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    unreadable = "\n".join(out["unreadable"])
    assert "00/pyspy-native.json: not py-spy's JSON" in unreadable
    assert "02/pyspy-native.json: not a list of threads" in unreadable
    assert "12/flight-recorder.pkl: not a flight-recorder trace" in unreadable
    assert "41/proc.json: not a JSON object" in unreadable
    assert any(r.startswith("pid 10: native stacks") and "flight recorder" in r for r in out["rests_on"])
    text = hangwatchd("analyze", str(tmp_path)).stdout
    assert "Could not be read:" in text and "The verdict rests on:" in text


def test_a_capture_is_stored_even_when_its_analysis_fails(tmp_path: Path, monkeypatch) -> None:
    from hangwatchd.capture.proc import ProcStep
    from hangwatchd.daemon import make_incident
    from hangwatchd.incidents.store import Store
    from hangwatchd.model import Suspicion
    from hangwatchd.workload.registration_file import from_proc

    def broken(_path: Path) -> None:
        raise KeyError("a bug in the analysis")

    monkeypatch.setattr(make_incident, "analyze", broken)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reg = from_proc(p.pid)
        assert reg is not None
        store = Store(tmp_path / "state")
        store.open()
        incident_id = make_incident.make_incident(store, [(ProcStep(), 5.0)], [reg], Suspicion("heartbeat", "test", 0.0), Deadline.after(30.0))
    finally:
        stop(p, sig=signal.SIGKILL)
    (inc,) = store.list()
    assert inc["id"] == incident_id and "analysis failed (KeyError" in inc["summary"]
    assert (Path(inc["dir"]) / str(p.pid) / "proc.json").exists()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(sorted(BAD_FILES) + ["pyspy.json", "nccl-ras.json", "nccl-ras.txt", "incident.json",
                                                             "introspect.json", "code.json"]),
                       st.one_of(st.binary(max_size=300), st.recursive(
                           st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(
                               ["rank", "pid", "frames", "name", "line", "devices", "process_gpus", "index",
                                "utilization_percent", "kernels", "pcs", "exceptions", "device", "file", "communicators",
                                "pg_status", "entries", "processes", "steps", "threads", "graph_replay", "native_id",
                                "lines", "code"]), c, max_size=4), max_leaves=20).map(
                           lambda v: json.dumps(v).encode())), min_size=1, max_size=5))
def test_the_incident_dir_readers_never_raise(tmp_path_factory, files: dict[str, bytes]) -> None:
    root = tmp_path_factory.mktemp("fuzz")
    pdir = root / "77"
    pdir.mkdir()
    for name, content in files.items():
        (root if name == "incident.json" else pdir).joinpath(name).write_bytes(content)
    import time

    start = time.monotonic()
    out = analyze(root)
    assert time.monotonic() - start < 5
    # introspect.json and code.json only add to a process's stacks: alone they make no process
    assert out.summary and len(out.ranks) == (1 if set(files) - {"incident.json", "introspect.json", "code.json"} else 0)
    from hangwatchd.report import incident as report

    assert report.render_analysis(out.to_dict()).startswith(out.summary)
    if "incident.json" not in files:  # the daemon writes that one; the process's files come from the workload
        assert report.render_text(report.load(root, out.to_dict())).startswith(out.summary)  # hangwatchd show reads them too


CATALOGUE_CASES = [
    # (native frames of the main thread, the verdict, what the gate and the detector see)
    (["cuStreamSynchronize", "Tensor.item", "train_step"], "waiting-on-gpu", "cuStreamSynchronize"),
    (["ncclAllReduce", "c10d::ProcessGroupNCCL::allreduce", "all_reduce", "train_step"], "in-collective", "ncclAllReduce"),
    (["pthread_mutex_lock", "Lock.acquire", "train_step"], "lock-wait", None),
    (["epoll_wait", "select", "EpollSelector.select", "_run_once", "serve"], "idle-python", None),
]


@pytest.mark.parametrize("frames,verdict,gate", CATALOGUE_CASES, ids=[c[1] for c in CATALOGUE_CASES])
def test_the_detector_the_gpu_dump_gate_and_the_verdict_read_one_catalogue(tmp_path: Path, frames: list[str],
                                                                             verdict: str, gate: str | None) -> None:
    from hangwatchd.analyze.stacks import gpu_wait
    from hangwatchd.detect.stack import BLOCKING, IDLE, classify

    main = [{"name": n, "filename": "/srv/job/train.py" if n in ("train_step", "serve") else "lib.so",
             "short_filename": "libcuda.so.1" if n.startswith("cu") else "x.so", "line": 1} for n in frames]
    # every NCCL process also has its proxy thread and PyTorch's watchdog sitting in NCCL: never the verdict
    proxy = [{"name": "ncclProxyService", "short_filename": "libnccl.so.2", "line": 0},
             {"name": "c10d::ProcessGroupNCCL::ncclCommWatchdog", "short_filename": "libtorch_cuda.so", "line": 0}]
    pdir = tmp_path / "5"
    pdir.mkdir()
    (pdir / "pyspy-native.json").write_text(json.dumps([{"thread_name": "MainThread", "frames": main},
                                                         {"thread_name": "nccl", "frames": proxy}]))
    (v,) = analyze(tmp_path).ranks
    assert v.verdict == verdict, v
    names = [str(n) for n in frames] + [str(f["name"]) for f in proxy]
    blocked, idle = classify(names, BLOCKING, IDLE)
    assert (blocked is not None) == (verdict != "idle-python") and idle == (verdict == "idle-python")
    if gate:
        assert gpu_wait(pdir) == gate and blocked == gate
    else:
        assert gpu_wait(pdir) is None  # NCCL's own threads in libnccl do not count


def test_a_launch_blocked_behind_a_stream_that_never_moves_names_cu_launch_kernel(tmp_path: Path) -> None:
    pdir = stream_incident(tmp_path, [1], 0)
    stack = (pdir / "pyspy-native.json").read_text()  # the real stack, its wait made a launch behind a full queue
    (pdir / "pyspy-native.json").write_text(stack.replace('"cuStreamSynchronize"', '"cuLaunchKernel"')
                                            .replace('"cudaStreamSynchronize"', '"cudaLaunchKernel"'))
    (v,) = analyze(tmp_path).ranks
    assert v.verdict == "stream-deadlock" and v.detail.startswith("host blocked in cuLaunchKernel while")


# -- a raw GPU dump in a directory put together by hand -------------------------------------------

def recompress(src: Path, dst: Path) -> None:
    """A fixture dump (.xz) as the suffix of ``dst`` says: raw, .zst, .gz or .xz."""
    import gzip
    import lzma

    import zstandard

    raw = lzma.decompress(src.read_bytes())
    packed = {".zst": lambda b: zstandard.ZstdCompressor().compress(b), ".gz": gzip.compress, ".xz": lzma.compress,
              ".nvcudmp": lambda b: b}[dst.suffix]
    dst.write_bytes(packed(raw))


@pytest.mark.parametrize("name", ["coredump.nvcudmp", "coredump.nvcudmp.zst", "coredump.nvcudmp.gz", "coredump.nvcudmp.xz"])
def test_analyze_symbolises_a_raw_dump_found_without_symbolized_json(tmp_path: Path, name: str) -> None:
    pdir = tmp_path / "77"
    pdir.mkdir()
    recompress(FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz", pdir / name)
    out = json.loads(hangwatchd("analyze", str(tmp_path), "--json").stdout)
    assert out["summary"] == ("pid 77: WARP_ILLEGAL_ADDRESS in faulty_epilogue_kernel(int*, long) at store_at(int*, long, int) "
                              "(inlined.cu:9) ← epilogue(int*, long, int) (inlined.cu:13) ← faulty_epilogue_kernel(int*, long) "
                              "(inlined.cu:17)."), out["summary"]
    assert out["rests_on"] == ["pid 77: GPU dump; sure: the GPU dump names the exception and the kernel"]
    assert not (pdir / "symbolized.json").exists()  # read, never written into


def test_analyze_tells_a_stream_wait_from_a_raw_dump_as_the_daemon_does(tmp_path: Path) -> None:
    """The hung Triton job's dump, raw beside its native stack: no kernel runs on the process's GPU 1."""
    stream_incident(tmp_path, [1], 0, dump=False)
    shutil.copy(FIXTURES / "triton_hang" / "coredump.nvcudmp.xz", tmp_path / "1110")
    out = json.loads(hangwatchd("analyze", str(tmp_path), "--json").stdout)
    (v,) = out["ranks"]
    assert v["verdict"] == "stream-deadlock"
    assert "host blocked in cuStreamSynchronize while the GPU dump shows no kernel running on GPU 1" in v["detail"]
    # With the process on GPU 0 the same dump shows its kernel spinning there.
    (tmp_path / "1110" / "nvml.json").write_text(json.dumps({"devices": [{"index": 0, "utilization_percent": 100}],
                                                             "process_gpus": [0]}))
    out = json.loads(hangwatchd("analyze", str(tmp_path), "--json").stdout)
    assert out["ranks"][0]["verdict"] == "gpu-kernel-spinning" and "conditional_hang_kernel" in out["ranks"][0]["detail"]


def test_a_raw_dump_that_is_junk_or_a_link_is_one_line_never_an_error(tmp_path: Path) -> None:
    """Read as any untrusted dump (the sandbox's limits bound its time and memory: tests/cudacore)."""
    import zstandard

    cases = {
        "junk": ("coredump.nvcudmp", b"\x7fELF" + b"\0" * 4000, "not a 64-bit little-endian ELF file"),
        "inflated": ("coredump.nvcudmp.zst", zstandard.ZstdCompressor().compress(b"\0" * (64 << 20)), "not symbolised"),
        "link": ("coredump.nvcudmp", None, "symlinks are refused"),
    }
    for pid, (name, data, _said) in enumerate(cases.values(), 100):
        pdir = tmp_path / str(pid)
        pdir.mkdir()
        if data is None:
            (pdir / name).symlink_to(FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz")
        else:
            (pdir / name).write_bytes(data)
    res = hangwatchd("analyze", str(tmp_path), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for pid, (name, _data, said) in enumerate(cases.values(), 100):
        line = next((p for p in out["unreadable"] if p.startswith(f"{pid}/{name}")), "")
        assert said in line, (pid, out["unreadable"])


def test_an_exception_caught_alive_names_the_line_where_it_surfaced_from_real_stacks(tmp_path: Path) -> None:
    """A real native stack from an H200 (the host in cuStreamSynchronize under main, conditional_hang.py:34)
    beside the real dump of PyTorch's faulting indexing kernel: the verdict names both, the kernel's
    long template name cut to what a person reads."""
    pdir = tmp_path / "1303"
    pdir.mkdir()
    (pdir / "proc.json").write_text(json.dumps({"pid": 1303}))
    shutil.copy(FIXTURES / "triton_hang" / "pyspy-native.json", pdir)
    shutil.copy(FIXTURES / "torch_ima" / "coredump.nvcudmp.xz", pdir)
    (v,) = json.loads(hangwatchd("analyze", str(tmp_path), "--json").stdout)["ranks"]
    assert v["verdict"] == "gpu-exception"
    assert v["detail"].startswith("WARP_ILLEGAL_ADDRESS in at::native::index_elementwise_kernel<…>(…) (no source lines in its cubin), "
                                  "surfaced in main (conditional_hang.py:34); with asynchronous launches"), v["detail"]
    assert v["location"] == "main (/srv/gpuapp/conditional_hang.py:34)"


def test_the_thread_in_the_gpu_call_is_where_it_surfaced_not_the_main_thread_or_a_helper() -> None:
    from hangwatchd.analyze import surfaced

    def frame(name: str, file: str, line: int = 1) -> dict[str, object]:
        return {"name": name, "filename": file, "line": line}

    threads = [
        {"thread_name": "MainThread", "os_thread_id": 1, "frames": [frame("Queue.get", "/usr/lib/python3.11/queue.py"),
                                                                     frame("<module>", "/app/serve.py", 20)]},
        {"thread_name": "pt_autograd_0", "os_thread_id": 2, "frames": [frame("cudaStreamSynchronize", "libtorch_cuda.so")]},
        {"thread_name": "model-runner", "os_thread_id": 3,
         "frames": [{"name": "cudaStreamSynchronize", "filename": "libtorch_cuda.so", "module": "libtorch_cuda.so", "line": 0},
                    frame("Tensor.item", "/x/site-packages/torch/_tensor.py", 9), frame("run_model", "/app/serve.py", 12)]},
    ]
    found = surfaced.find(threads)
    assert found is not None and found.thread == "model-runner" and found.call == "cudaStreamSynchronize"
    assert found.text() == "thread model-runner at run_model (serve.py:12)"
    assert surfaced.find(threads[:2]) is None  # nobody in a call that waits for the GPU: no line is claimed
    # The process's own word on where that thread last replayed a CUDA graph (matched by its native id).
    report = {"threads": [{"native_id": 1, "graph_replay": {"function": "warm", "file": "/app/serve.py", "line": 5}},
                          {"native_id": 3, "graph_replay": {"function": "run_model", "file": "/app/serve.py", "line": 11}},
                          {"native_id": "3", "graph_replay": {"line": "x"}}, "junk"]}
    told = surfaced.find(threads, surfaced.replays(report))
    assert told is not None and told.text() == ("thread model-runner at run_model (serve.py:12), after the last replay "
                                                "of a CUDA graph in that thread at run_model (serve.py:11)")
    assert surfaced.short_name("faulty_epilogue_kernel(int*, long)") == "faulty_epilogue_kernel(int*, long)"
