"""The cause elsewhere on the node: a stuck child process, a thread deadlock, the GIL held in C, a GPU
shared with another tenant. Real processes, real py-spy, the real daemon; GPU cases on hand-made
incident directories with NVML's per-process numbers and the real fixture dumps."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.analyze.verdict import analyze
from hangwatchd.cudacore.symbolize import symbolize
from hangwatchd.testing import ScratchDaemon, stop, wait_for

from .conftest import FIXTURES, hangwatchd

WORKLOADS = Path(__file__).parent / "cause"
ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"stack_interval": 0.5, "stack_window": 3.0, "gpu_dump": "never"}


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{WORKLOADS}{os.pathsep}{ROOT}")


def started(proc: subprocess.Popen[Any]) -> None:  # started with text=True
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"the workload did not start: {line!r}"


def incident(d: ScratchDaemon) -> tuple[dict[str, Any], Path]:
    """The one incident's incident.json (its verdict, its processes) and its directory."""
    (inc,) = wait_for(d.settled, 60, "an incident")
    return json.loads((Path(inc["dir"]) / "incident.json").read_text()), Path(inc["dir"])


@pytest.fixture
def shards(tmp_path: Path) -> Any:
    """Three shards that are plain files, and shard-0042: a FIFO this test holds open for writing and never writes."""
    d = tmp_path / "data"
    d.mkdir()
    for i in range(3):
        (d / f"shard-{i:04d}").write_bytes(b"x" * (100 + i))
    os.mkfifo(d / "shard-0042")
    d.chmod(0o755)
    writer = os.open(d / "shard-0042", os.O_RDWR | os.O_NONBLOCK)  # a reader's open never blocks; its read does
    yield d
    os.close(writer)


def test_a_worker_stuck_reading_a_fifo_leads_the_verdict_and_is_in_the_incident(tmp_path: Path, shards: Path) -> None:
    with ScratchDaemon(tmp_path / "d", config=CONFIG) as d:
        work = d.run([sys.executable, str(WORKLOADS / "train.py"), str(shards)], "--heartbeat-timeout", "2",
                     stdout=subprocess.PIPE, text=True, env=env(), start_new_session=True)
        try:
            started(work)
            inc, path = incident(d)
        finally:
            stop(work, group=True)
    parent = inc["processes"][0]["pid"]
    kids = {int(p.name): json.loads((p / "proc.json").read_text()) for p in path.iterdir()
            if p.is_dir() and p.name != str(parent) and (p / "proc.json").exists()}
    assert len(kids) == 2 and all(k["parent"] == parent for k in kids.values())
    (stuck,) = [pid for pid, k in kids.items() if k["blocked_on"].get("kind") == "FIFO"]
    k = kids[stuck]
    page = (path / "report.html").read_text()  # the stored page shows the stuck worker and its stack
    assert f"Child process {k['role']} {stuck} (child of {parent}): child-stuck" in page
    assert "read_shard (" in page[page.index(f"Child process {k['role']} {stuck}"):]
    assert k["role"].startswith("multiprocessing worker ") and k["blocked_on"]["path"] == str(shards / "shard-0042")
    assert k["blocked_on"]["syscall"] == "read" and k["blocked_on"]["wchan"]
    assert (path / str(stuck) / "pyspy.json").exists() and (path / str(stuck) / "pyspy-native.json").exists()
    # The FIFO's write end is held by this test (the shards fixture), which never writes: the verdict
    # names it, then how the parent reaches the stuck worker.
    assert inc["verdict"].startswith(
        f"{k['role']} (pid {stuck}) is stuck in read_shard (loader.py:9), reading FIFO {shards}/shard-0042, "
        f"whose other end only pid {os.getpid()} (")
    assert f"; its parent (pid {parent}) waits for it in Queue.get (train.py:15)" in inc["verdict"]
    # The parent's helper thread (multiprocessing's QueueFeederThread, in a condition wait) is not the story.
    assert "QueueFeederThread" not in inc["verdict"] and "lock" not in inc["verdict"]
    children = json.loads((path / str(parent) / "children.json").read_text())
    assert {c["pid"] for c in children["children"]} == set(kids)
    # The parent reads the results pipe that both workers hold: it waits for them.
    assert children["blocked_on"]["kind"] == "pipe" and set(children["blocked_on"]["held_by"]) == set(kids)
    out = json.loads(hangwatchd("analyze", str(path), "--json").stdout)
    assert out["ranks"][0]["verdict"] == "child-stuck" and [r["pid"] for r in out["ranks"]] == [parent]
    assert {c["pid"]: c["role"] for c in out["children"]} == {pid: kk["role"] for pid, kk in kids.items()}
    text = hangwatchd("analyze", str(path)).stdout
    assert f"  {k['role']} pid {stuck} (of pid {parent}): child-stuck - stuck in read_shard (loader.py:9), reading FIFO" in text
    idle = next(c for c in out["children"] if c["pid"] != stuck)  # the other worker waits for work: not the story
    assert idle["verdict"] == "idle-python" and idle["detail"] == "waiting for work in Queue.get" and idle["parent"] == parent
    # Without the children's capture the parent is still read right: it waits for its children.
    bare = shutil.copytree(path, tmp_path / "without-children")
    for pid in kids:
        shutil.rmtree(bare / str(pid))
    (v,) = analyze(bare).ranks
    assert v.verdict == "waiting-on-children" and "Queue.get" in v.detail


def test_a_subprocess_that_is_no_python_program_is_named_by_what_it_is_blocked_on(tmp_path: Path, shards: Path) -> None:
    work = subprocess.Popen([sys.executable, str(WORKLOADS / "waits_on_cat.py"), str(shards / "shard-0042")],
                            stdout=subprocess.PIPE, text=True, env=env(), start_new_session=True)
    try:
        started(work)
        cat = wait_for(lambda: [int(c) for c in Path(f"/proc/{work.pid}/task/{work.pid}/children").read_text().split()], 10, "cat")[0]
        wait_for(lambda: Path(f"/proc/{cat}/wchan").read_text() not in ("", "0"), 10, "cat asleep")
        res = hangwatchd("capture", str(work.pid), "--json", "--state-dir", str(tmp_path / "st"), "--runtime-dir", str(tmp_path / "rt"))
    finally:
        stop(work, group=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["verdict"].startswith(f"subprocess cat (pid {cat}) is stuck in a system call, reading FIFO {shards}/shard-0042, "
                                     f"whose other end only pid {os.getpid()} ("), out["verdict"]
    assert f"; its parent (pid {work.pid}) waits for it in Popen.communicate (waits_on_cat.py:12)" in out["verdict"]


def stack_hang(base: Path, argv: list[str], config: dict[str, object] = CONFIG,
               *options: str) -> tuple[dict[str, Any], Path, int]:
    """A never-instrumented workload watched by its stack (2 s) under its own daemon: its incident,
    that incident's directory and the workload's pid, the workload stopped."""
    with ScratchDaemon(base / "d", config=config) as d:
        work = d.run(argv, "--stack-timeout", "2", "--heartbeat-timeout", "3600", *options, stdout=subprocess.PIPE,
                     text=True, env=env())
        try:
            started(work)
            inc, path = incident(d)
        finally:
            stop(work, sig=signal.SIGKILL)
    return inc, path, work.pid


def test_a_lock_order_deadlock_names_both_threads_their_locks_and_the_join(tmp_path: Path) -> None:
    # Under hangwatchd run the process answers which lock each thread holds and waits for.
    inc, path, _ = stack_hang(tmp_path, [sys.executable, str(WORKLOADS / "server.py")])
    pid = inc["processes"][0]["pid"]
    assert inc["verdict"] == (f"pid {pid}: deadlock between thread cache (update_cache, server.py:14), waiting for lock "
                              "stats_lock (thread stats) and thread stats (report_stats, server.py:21), waiting for lock "
                              "cache_lock (thread cache); thread MainThread waits for thread cache to end in Thread.join "
                              "(server.py:31)."), inc["verdict"]
    (v,) = analyze(path).ranks
    assert v.verdict == "thread-deadlock" and v.location == f"update_cache ({WORKLOADS / 'server.py'}:14)"


def test_a_queue_join_waits_for_the_item_a_stuck_worker_holds_not_for_the_idle_one(tmp_path: Path) -> None:
    """Queue.join on an empty queue: one worker holds the unfinished item, stuck in a read; the other
    waits in get for more. The chain goes through the stuck one to its read."""
    inc, _, _ = stack_hang(tmp_path, [sys.executable, str(WORKLOADS / "uploads.py")])
    verdict = inc["verdict"]
    assert "upload (uploads.py:16)" in verdict and "receiving on a unix socket" in verdict, verdict
    assert "task_done" not in verdict and "MainThread waits for every item of queue work to be marked done" in verdict, verdict


def test_the_same_deadlock_without_introspection_from_python_frames_alone_reads_the_kernel_s_futex_waits(tmp_path: Path) -> None:
    # Neither the process's answer nor native frames: two threads each in a futex wait under their
    # own frame, none running, is a deadlock whose locks the evidence does not name.
    inc, path, work_pid = stack_hang(tmp_path, [sys.executable, str(WORKLOADS / "server.py")], {**CONFIG, "pyspy_native": False},
                                     "--no-introspect")
    assert not (path / str(work_pid) / "pyspy-native.json").exists() and not (path / str(work_pid) / "introspect.json").exists()
    assert "deadlock between threads cache (update_cache, server.py:14) and stats (report_stats, server.py:21)" in inc["verdict"]


@pytest.fixture(scope="module")
def libspin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the spinning routine")
    out = tmp_path_factory.mktemp("spin") / "libspin.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(out), str(WORKLOADS / "spin.c")], check=True)
    out.parent.chmod(0o755)
    return out


def test_a_thread_spinning_in_c_with_the_gil_held_is_its_own_verdict(tmp_path: Path, libspin: Path) -> None:
    inc, path, _ = stack_hang(tmp_path, [sys.executable, str(WORKLOADS / "gil.py"), str(libspin)])
    pid = inc["processes"][0]["pid"]
    assert inc["verdict"] == (f"pid {pid}: thread MainThread holds the GIL while spinning in C in spin_forever (libspin.so), "
                              "called from checksum (gil.py:19); the other thread cannot run Python."), inc["verdict"]
    (v,) = analyze(path).ranks
    assert v.verdict == "gil-held-in-c" and v.location == f"checksum ({WORKLOADS / 'gil.py'}:19)"


def open_files(pid: int) -> list[str]:
    """What ``pid`` holds open; a descriptor closed while the list is read (a forked worker closes
    its parent's pipes as it starts) is left out."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def test_workers_of_a_watched_process_are_not_discovered_as_processes_of_their_own(tmp_path: Path, fake_gpu: Path) -> None:
    code = (f"import multiprocessing as mp, time\nf = open({str(fake_gpu)!r})\n"
            "def worker():\n    time.sleep(600)\n"
            "if __name__ == '__main__':\n    mp.set_start_method('fork')\n    w = mp.Process(target=worker); w.start()\n"
            "    print('READY', w.pid, flush=True)\n    time.sleep(600)\n")
    with ScratchDaemon(tmp_path / "d", config={**CONFIG, "discover": True, "rescan_interval": 0.3}) as d:
        work = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert work.stdout is not None
            worker = int(work.stdout.readline().split()[1])
            assert str(fake_gpu) in open_files(worker)

            def watched() -> list[int]:
                return [p["pid"] for p in json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)["processes"]]

            assert wait_for(watched, 10, "the parent discovered") == [work.pid]
            d.looked(3, what="discovery")  # three more discovery passes, each handed to the loop
            assert watched() == [work.pid]
        finally:
            stop(work, group=True)


# -- GPU verdicts on hand-made incident directories ---------------------------------------------


def gpu_incident(tmp_path: Path, own: dict[str, int] | None, device: int, dump: str | None) -> Path:
    """The real hung Triton job's native stack (host in cuStreamSynchronize) on GPU 0, shared with pid 4321.

    ``own``: NVML's per-process share of each GPU (process_sm_percent); ``device``: the device-wide
    utilisation; ``dump``: "running" for the real dump (its kernel spins on GPU 0), "none" for the
    same dump with its grid pending behind a stream wait (no warp on any SM), None for no dump.
    """
    pdir = tmp_path / "1110"
    pdir.mkdir(parents=True)
    (pdir / "proc.json").write_text(json.dumps({"pid": 1110}))
    shutil.copy(FIXTURES / "triton_hang" / "pyspy-native.json", pdir)
    if dump:
        sym = symbolize(FIXTURES / "triton_hang" / "coredump.nvcudmp.xz").to_dict()
        if dump == "none":
            kernels: list[dict[str, Any]] = sym["kernels"]  # type: ignore[assignment]  # to_dict is JSON: a list of dicts here
            sym["kernels"] = [dict(k, status="pending", sms=[]) for k in kernels]
            sym["pcs"] = []
        (pdir / "symbolized.json").write_text(json.dumps(sym))
    nvml: dict[str, Any] = {
        "devices": [{"index": 0, "utilization_percent": device, "processes": [{"pid": 1110}, {"pid": 4321}]}],
        "process_gpus": [0]}
    if own is not None:
        nvml["process_sm_percent"] = own
    (pdir / "nvml.json").write_text(json.dumps(nvml))
    return pdir


def test_a_stream_deadlock_on_a_gpu_shared_with_a_busy_process_is_named_from_the_process_s_own_share(tmp_path: Path) -> None:
    gpu_incident(tmp_path, {"0": 0}, 100, None)
    (v,) = analyze(tmp_path).ranks
    assert v.verdict == "stream-deadlock"
    assert v.detail.startswith("host blocked in cuStreamSynchronize while NVML's per-process samples show this process "
                               "running nothing on GPU 0; GPU 0 is shared, 100% busy with other processes (4321)")


def test_device_wide_utilisation_alone_is_never_taken_as_the_process_s(tmp_path: Path) -> None:
    gpu_incident(tmp_path / "a", None, 100, None)  # no per-process samples: no claim either way
    (v,) = analyze(tmp_path / "a").ranks
    assert v.verdict == "waiting-on-gpu" and v.detail.endswith("GPU 100% busy (device-wide, all processes)")
    gpu_incident(tmp_path / "b", {"0": 96}, 100, None)  # its own kernels keep it busy: it waits on them
    (v,) = analyze(tmp_path / "b").ranks
    assert v.verdict == "waiting-on-gpu" and "GPU 0: this process 96%, device 100% busy with all its processes" in v.detail


def test_a_dump_with_no_kernel_running_is_a_stream_deadlock_whatever_the_device_reads(tmp_path: Path) -> None:
    gpu_incident(tmp_path, None, 100, "none")
    (v,) = analyze(tmp_path).ranks
    assert v.verdict == "stream-deadlock"
    assert "the GPU dump shows no kernel running on GPU 0; GPU 0 is shared, 100% busy with other processes (4321)" in v.detail


def test_a_running_kernel_in_the_dump_stays_the_story_on_a_shared_gpu(tmp_path: Path) -> None:
    gpu_incident(tmp_path, {"0": 100}, 100, "running")
    (v,) = analyze(tmp_path).ranks
    assert v.verdict == "gpu-kernel-spinning" and "conditional_hang_kernel" in v.detail
    assert "GPU 0: this process 100%, device 100% busy with all its processes" in v.detail


# -- the verdict catalogue ----------------------------------------------------------------------


def rank_dir(root: Path, pid: int, rank: int | None, frames: list[tuple[str, str, int]] | None, **proc: Any) -> None:
    pdir = root / str(pid)
    pdir.mkdir(parents=True)
    (pdir / "proc.json").write_text(json.dumps({"pid": pid, "rank": rank, **proc}))
    if frames is not None:
        (pdir / "pyspy.json").write_text(json.dumps([{"thread_name": "MainThread", "os_thread_id": pid, "active": False,
                                                      "frames": [{"name": n, "filename": f, "line": ln} for n, f, ln in frames]}]))


def test_the_odd_rank_out_and_a_process_that_was_gone_before_it_was_read(tmp_path: Path) -> None:
    waiting = [("all_reduce", "/srv/job/site-packages/torch/distributed/c10d.py", 10), ("step", "/srv/job/train.py", 40)]
    for pid, rank in ((11, 0), (12, 1)):
        rank_dir(tmp_path / "odd", pid, rank, waiting)
    rank_dir(tmp_path / "odd", 13, 2, [("Lock.acquire", "/usr/lib/python3.11/threading.py", 5), ("save_checkpoint", "/srv/job/ckpt.py", 7)])
    out = analyze(tmp_path / "odd")
    # Rank 2 alone waits for a lock, and no other thread of it could hold it: the lock is held by a
    # thread that is gone, or by its own stack further up; the others wait in the collective for it.
    assert out.summary.startswith("Rank 2 is the odd one out: the main thread waits in save_checkpoint (ckpt.py:7) "
                                  "for a lock: no other live thread could hold it"), out.summary
    assert out.summary.endswith("while the other ranks are in-collective."), out.summary
    rank_dir(tmp_path / "gone", 21, None, None, state="Z (zombie)")
    (v,) = analyze(tmp_path / "gone").ranks
    assert v.verdict == "dead" and v.detail == "the process had exited before it could be read"
    rank_dir(tmp_path / "lost", 31, 0, waiting)
    rank_dir(tmp_path / "lost", 32, 1, None, state="Z (zombie)")
    assert analyze(tmp_path / "lost").summary == ("Rank 0 waits in all_reduce; rank 1: the process had exited before it "
                                                  "could be read, so the one that did not join is there.")


def test_the_verdict_catalogue_lists_every_verdict_the_analysis_gives() -> None:
    import re

    from hangwatchd.analyze.records import VERDICT_KINDS

    given: set[str] = set()
    for path in (ROOT / "hangwatchd" / "analyze").glob("*.py"):
        text = path.read_text()
        given |= set(re.findall(r'\bverdict\("([a-z-]+)"', text))
        given |= set(re.findall(r'verdict="([a-z-]+)"', text))
        given |= set(re.findall(r'RankVerdict\([^()]*?"([a-z]+(?:-[a-z]+)+|exited)"', text))
    assert given <= set(VERDICT_KINDS), f"verdicts given but not declared: {sorted(given - set(VERDICT_KINDS))}"
    listed = set(re.findall(r"^### `([a-z-]+)`", (ROOT / "docs" / "verdicts.md").read_text(), re.M))
    assert set(VERDICT_KINDS) - listed == set(), f"verdicts missing from docs/verdicts.md: {sorted(set(VERDICT_KINDS) - listed)}"


def thread(name: str, tid: int, frames: list[tuple[str, str, int]], **extra: Any) -> dict[str, Any]:
    return {"thread_name": name, "os_thread_id": tid, "active": False, "owns_gil": False,
            "frames": [{"name": n, "filename": f, "short_filename": f.rsplit("/", 1)[-1], "line": ln, **extra}
                       for n, f, ln in frames]}


TORCH = "/opt/venv/lib/python3.11/site-packages/torch/utils/data"
MP = "/usr/lib/python3.11/multiprocessing"


def test_a_dataloader_incident_put_together_by_hand_leads_with_the_stuck_worker(tmp_path: Path) -> None:
    """A PyTorch DataLoader's shapes, as py-spy shows them (CPU here; tests/gpu/run_cause.py runs the real one):
    the training loop in _next_data, a QueueFeederThread in a condition wait, worker 1 in read_shard."""
    from hangwatchd.capture.children import role_of

    parent = tmp_path / "100"
    parent.mkdir()
    (parent / "proc.json").write_text(json.dumps({"pid": 100, "parent": 1, "blocked_on": {"text": "waiting in poll on a pipe"}}))
    (parent / "pyspy.json").write_text(json.dumps([
        thread("QueueFeederThread", 103, [("Condition.wait", "/usr/lib/python3.11/threading.py", 327),
                                          ("Queue._feed", f"{MP}/queues.py", 231)]),
        thread("MainThread", 100, [("poll", "/usr/lib/python3.11/selectors.py", 416), ("Queue.get", f"{MP}/queues.py", 113),
                                   ("_MultiProcessingDataLoaderIter._try_get_data", f"{TORCH}/dataloader.py", 1275),
                                   ("_MultiProcessingDataLoaderIter._get_data", f"{TORCH}/dataloader.py", 1446),
                                   ("_MultiProcessingDataLoaderIter._next_data", f"{TORCH}/dataloader.py", 1485),
                                   ("_BaseDataLoaderIter.__next__", f"{TORCH}/dataloader.py", 733),
                                   ("train", "/srv/job/train.py", 33)])]))
    worker = [("read_shard", "/srv/job/loader.py", 17), ("Shards.__getitem__", "/srv/job/loader.py", 30),
              ("_MapDatasetFetcher.fetch", f"{TORCH}/_utils/fetch.py", 52), ("_worker_loop", f"{TORCH}/_utils/worker.py", 349)]
    idle = [("poll", "/usr/lib/python3.11/selectors.py", 416), ("Queue.get", f"{MP}/queues.py", 113),
            ("_worker_loop", f"{TORCH}/_utils/worker.py", 309)]
    for pid, wid, frames, blocked in ((101, 0, idle, {"syscall": "poll", "fds": [{"fd": 5, "kind": "pipe", "path": "pipe:[7]"}],
                                                      "text": "waiting in poll on a pipe (pipe:[7])"}),
                                      (102, 1, worker, {"syscall": "read", "kind": "FIFO", "path": "/data/shard-0042",
                                                        "text": "reading FIFO /data/shard-0042"})):
        threads = [thread("MainThread", pid, frames, locals=[{"name": "worker_id", "repr": str(wid)}])]
        role = role_of("pt_data_worker", threads, ["python", "train.py"])
        assert role == f"DataLoader worker {wid}"
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "proc.json").write_text(json.dumps({"pid": pid, "parent": 100, "role": role, "blocked_on": blocked}))
        (d / "pyspy.json").write_text(json.dumps(threads))
    out = json.loads(hangwatchd("analyze", str(tmp_path), "--json").stdout)
    assert out["summary"] == ("DataLoader worker 1 (pid 102) is stuck in read_shard (loader.py:17), reading FIFO /data/shard-0042; "
                              "the training loop waits for it in _next_data (train.py:33).")
    assert [(c["role"], c["verdict"]) for c in out["children"]] == [("DataLoader worker 0", "idle-python"),
                                                                     ("DataLoader worker 1", "child-stuck")]
    # The page a person opens: the children judged, and the stuck worker's own stack, open.
    from hangwatchd.analyze.verdict import analyze
    from hangwatchd.report import html, incident

    page = html.render(incident.load(tmp_path, analyze(tmp_path).to_dict()), tmp_path)
    table = page.index("<h2>Children of the hung processes</h2>")
    assert page.index("DataLoader worker 1", table) < page.index("DataLoader worker 0", table)  # the stuck one first
    stuck = page.index("<h2>Child process DataLoader worker 1 102 (child of 100): child-stuck</h2>")
    assert page.index("read_shard (/srv/job/loader.py:17)", stuck) > stuck
    assert "<details><summary>Child process DataLoader worker 0 101 (child of 100): idle-python</summary>" in page
    assert page.count("<h2>Process ") == 1  # the children are not shown again as hung processes


from hypothesis import HealthCheck, given, settings  # noqa: E402 - hypothesis only for the property tests below
from hypothesis import strategies as st  # noqa: E402 - hypothesis only for the property tests below

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 100) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(
        ["pid", "parent", "role", "blocked_on", "held_by", "text", "object", "thread_name", "os_thread_id", "active",
         "owns_gil", "frames", "name", "filename", "short_filename", "line", "module", "threads", "tid", "wchan",
         "process_sm_percent", "process_gpus", "devices", "index", "utilization_percent", "processes", "0", "77"]),
        c, max_size=5), max_leaves=24)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["77/proc.json", "77/pyspy.json", "77/nvml.json", "77/children.json",
                                        "78/proc.json", "78/pyspy-native.json"]),
                       _VALUES.map(lambda v: json.dumps(v).encode()), min_size=1, max_size=6))
def test_a_process_tree_read_from_any_files_never_raises(tmp_path_factory: pytest.TempPathFactory, files: dict[str, bytes]) -> None:
    root = tmp_path_factory.mktemp("tree")
    # A child of 77 always, whatever else its proc.json holds, so the tree's own reading is what is fuzzed.
    (root / "78").mkdir()
    child = {"pid": 78, "parent": 77, "role": "DataLoader worker 1", "blocked_on": {"text": "reading FIFO /x"}}
    raw = files.pop("78/proc.json", b"{}")
    extra = json.loads(raw)
    (root / "78" / "proc.json").write_text(json.dumps({**extra, **child} if isinstance(extra, dict) else child))
    (root / "77").mkdir()
    (root / "77" / "pyspy.json").write_text(json.dumps([thread("MainThread", 77, [("Queue.get", f"{MP}/queues.py", 1),
                                                                                ("train", "/srv/train.py", 3)])]))
    for name, content in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(content)
    out = analyze(root)
    assert out.summary


def test_a_worker_blocked_in_library_code_on_a_socket_its_parent_does_not_hold_is_the_stuck_one(tmp_path: Path) -> None:
    (tmp_path / "200").mkdir()
    (tmp_path / "200" / "proc.json").write_text(json.dumps({"pid": 200}))
    (tmp_path / "200" / "pyspy.json").write_text(json.dumps([thread("MainThread", 200, [
        ("Popen.wait", f"{MP}/popen_fork.py", 43), ("BaseProcess.join", f"{MP}/process.py", 149), ("main", "/srv/job/main.py", 8)])]))
    socket_wait = [("SocketIO.readinto", "/usr/lib/python3.11/socket.py", 706), ("fetch", "/srv/job/fetch.py", 12),
                   ("BaseProcess.run", f"{MP}/process.py", 108)]
    waiting = [("Queue.get", f"{MP}/queues.py", 103), ("serve", "/srv/job/fetch.py", 20), ("BaseProcess.run", f"{MP}/process.py", 108)]
    for pid, frames, blocked in ((201, waiting, {"fd": 3, "kind": "pipe", "text": "reading a pipe (pipe:[5])", "held_by": [200]}),
                                 (202, socket_wait, {"fd": 7, "kind": "socket", "text": "receiving on a socket (socket:[99])"})):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "proc.json").write_text(json.dumps({"pid": pid, "parent": 200, "role": f"multiprocessing worker {pid - 200}",
                                                                   "blocked_on": blocked}))
        (tmp_path / str(pid) / "pyspy.json").write_text(json.dumps([thread("MainThread", pid, frames)]))
    assert analyze(tmp_path).summary == ("multiprocessing worker 2 (pid 202) is stuck in fetch (fetch.py:12), receiving on a socket "
                                         "(socket:[99]); its parent (pid 200) waits for it in BaseProcess.join (main.py:8).")


def test_a_join_of_a_thread_not_captured_is_said_as_unknown_never_blamed_on_the_waiter(tmp_path: Path) -> None:
    (tmp_path / "4637").mkdir()
    (tmp_path / "4637" / "pyspy.json").write_text(json.dumps([thread("MainThread", 4637, [
        ("Thread._wait_for_tstate_lock", "/usr/lib/python3.11/threading.py", 1139),
        ("Thread.join", "/usr/lib/python3.11/threading.py", 1119), ("main", "/srv/job/app.py", 4)])]))
    (v,) = analyze(tmp_path).ranks
    assert v.verdict == "unknown-wait"
    assert v.detail == ("the main thread waits in main (app.py:4) for a thread to end (Thread.join); who could end it is "
                        "not known: the thread it joins is not among the threads captured")
