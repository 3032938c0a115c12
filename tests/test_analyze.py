"""Verdicts and the rank that diverged, from real captures and hand-written flight-recorder records."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

from hangwatchd.analyze.verdict import analyze
from hangwatchd.cudacore.symbolize import symbolize
from hangwatchd.testing import Daemon, wait_for

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
    with Daemon(tmp_path, config={"gpu_dump": "never", "pyspy_native": False}) as d:
        ranks = []
        for r in (0, 1):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
            ranks.append(d.run([sys.executable, "-c", RANK_CODE], "--heartbeat-timeout", "1" if r == 0 else "60", env=env))
        try:
            (inc,) = wait_for(d.store().list, 20, "one incident for the job")
            assert inc["job"] == "10.0.0.1:29500" and len(inc["processes"]) == 2  # both ranks, one incident
        finally:
            for p in ranks:
                p.kill()
                p.wait()
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
    assert verdicts == {0: "in-collective", 1: "idle-python"}
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
        def __reduce__(self):  # type: ignore[no-untyped-def]
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
        p.kill()
        p.wait()
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
    with Daemon(tmp_path / "d") as d:
        blob = __import__("lzma").decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes())
        (d.state_dir / "dumps" / f"core_{__import__('socket').gethostname()}.77.1.nvcudmp").write_bytes(blob)
        (inc,) = wait_for(d.store().list, 20, "an incident")
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
