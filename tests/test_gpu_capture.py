"""GPU evidence on CPU: real FIFOs, real files written in pieces, the real fixture dumps.

The fake workload (hangwatchd.testing gpu-workload) plays the driver's and
PyTorch's parts: it holds the coredump and flight-recorder FIFOs open and
answers them as they do (or fails to, as they sometimes do).
"""

from __future__ import annotations

import importlib.util
import json
import lzma
import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from hangwatchd.incidents.store import Store
from hangwatchd.testing import ScratchDaemon, stop, wait_for

from .conftest import FIXTURES, hangwatchd


def gpu_workload(*args: str) -> list[str]:
    return [sys.executable, "-m", "hangwatchd.testing", "gpu-workload", *args]


def steps_of(inc: dict) -> dict[str, dict]:
    data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
    return {s["step"]: s for s in data["processes"][0]["steps"]}



def test_a_hung_process_goes_through_every_step_and_its_gpu_dump_is_explained(tmp_path: Path) -> None:
    d = ScratchDaemon(tmp_path, config={"gpu_dump": "always", "pyspy_native": False})
    work = d.run(gpu_workload("--dump", str(FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz")),
                 "--heartbeat-timeout", "1", "--rank", "0", stderr=subprocess.PIPE)
    try:
        (inc,) = wait_for(d.settled, 30, "an incident")
        steps = steps_of(inc)
        assert list(steps) == ["proc", "progress", "pyspy", "children", "exits", "introspect", "nvml", "nccl_ras",
                               "flight_recorder", "cuda_dump"]
        assert steps["introspect"]["ok"], steps["introspect"]  # the workload is Python under hangwatchd run: its reporter answered
        assert steps["flight_recorder"]["ok"], steps["flight_recorder"]
        # The daemon, as root, listens for process exits: the step files them (none here), never n/a.
        assert os.geteuid() != 0 or (steps["exits"]["ok"] and not steps["exits"]["not_applicable"]), steps["exits"]
        # no NCCL here: nothing listens on the RAS port hangwatchd run gave it, so n/a, and at once
        assert steps["nccl_ras"]["not_applicable"] and steps["nccl_ras"]["seconds"] < 0.5
        assert steps["nccl_ras"]["error"].startswith("nothing listens on 127.0.0.1:")
        assert steps["cuda_dump"]["ok"], steps["cuda_dump"]
        # No driver or GPU here: n/a with the reason, not a failure (nvidia-ml-py is installed, a dependency).
        assert steps["nvml"]["not_applicable"] and "no NVIDIA driver or GPU here" in steps["nvml"]["error"]
        assert not d.metric("hangwatchd_capture_step_failures_total", step="nvml")
        pdir = Path(inc["dir"]) / str(inc["processes"][0])
        sym = json.loads((pdir / "symbolized.json").read_text())
        assert sym["kernels"][0]["name"] == "consumer_kernel(int volatile*, int*)"
        assert [f["line"] for f in sym["pcs"][0]["frames"]] == [21, 25]
        raw = lzma.decompress((FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz").read_bytes())
        assert zstandard.ZstdDecompressor().stream_reader(open(pdir / "coredump.nvcudmp.zst", "rb")).read() == raw
        assert (pdir / "flight-recorder.pkl").stat().st_size > 0
        assert "coredump: All done" in (pdir / "driver.log").read_text()
        assert work.wait(10) == 134  # the dump ended it
        time.sleep(2)
        # The dump the capture asked for is not taken again as an exception dump.
        assert len(d.store().list()) == 1 and not list(d.dump_dir.glob("*.nvcudmp"))
    finally:
        stop(work)
        d.stop()


@pytest.mark.parametrize("shared", [True, False])
def test_gpu_dumps_on_one_gpu_are_triggered_one_at_a_time(tmp_path: Path, shared: bool) -> None:
    """The driver loses a dump triggered while another is being taken on the same GPU (seen on an H200):
    two ranks holding the same device file are dumped one after the other, the second triggered
    once the first's file is begun; ranks on different GPUs are triggered together."""
    devices = tmp_path / "dev"
    devices.mkdir()
    for n in (0, 1):
        (devices / f"gpu{n}").touch()
    config = {"gpu_dump": "always", "pyspy_native": False, "discover_devices": str(devices / "gpu"),
              "capture_steps": ["proc", "cuda_dump"]}
    with ScratchDaemon(tmp_path / "d", config=config) as d:
        ranks = []
        for r in (0, 1):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2")
            argv = gpu_workload("--fr", "none", "--dump-delay", "1.0", "--moments", str(tmp_path / f"moments{r}"),
                                "--hold-device", str(devices / f"gpu{0 if shared else r}"),
                                "--dump", str(FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz"))
            ranks.append(d.run(argv, "--job", "J", "--rank", str(r), "--heartbeat-timeout", "1", env=env))
        try:
            (inc,) = wait_for(d.settled, 40, "the incident settled", every=0.1)
            data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
            assert all(s["ok"] for p in data["processes"] for s in p["steps"] if s["step"] == "cuda_dump"), data
            asked = sorted(float(line.split()[1]) for r in (0, 1)
                           for line in (tmp_path / f"moments{r}").read_text().splitlines() if line.startswith("cuda-asked "))
            if shared:
                assert asked[1] - asked[0] >= 0.9  # the second waited for the first's dump to begin
            else:
                assert asked[1] - asked[0] < 0.5
        finally:
            for rank in ranks:
                stop(rank)


@pytest.mark.parametrize("mode, expect", [
    ("ignore", "no dump appeared"),
    ("half", "did not finish"),
])
def test_a_driver_that_never_dumps_or_stops_half_way(tmp_path: Path, mode: str, expect: str) -> None:
    d = ScratchDaemon(tmp_path, config={"gpu_dump": "always", "gpu_dump_timeout": 3.0, "flight_recorder_timeout": 1.0,
                                 "capture_steps": ["proc", "flight_recorder", "cuda_dump"]})
    work = d.run(gpu_workload("--cuda", mode, "--fr", "silent", "--dump", str(FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz")),
                 "--heartbeat-timeout", "1")
    try:
        (inc,) = wait_for(d.settled, 30, "an incident")
        steps = steps_of(inc)
        assert steps["proc"]["ok"]
        assert not steps["flight_recorder"]["ok"] and "wrote nothing" in steps["flight_recorder"]["error"]
        assert not steps["cuda_dump"]["ok"] and expect in steps["cuda_dump"]["error"], steps["cuda_dump"]
        assert steps["cuda_dump"]["seconds"] < 6
    finally:
        stop(work)
        d.stop()


def test_a_process_without_pipes_and_a_fifo_of_another_user(tmp_path: Path) -> None:
    d = ScratchDaemon(tmp_path, config={"gpu_dump": "always", "capture_steps": ["flight_recorder", "cuda_dump"]})
    plain = d.run([sys.executable, "-m", "hangwatchd.testing", "workload", "--beats", "3"], "--heartbeat-timeout", "1")
    try:
        (inc,) = wait_for(d.settled, 20, "an incident")
        steps = steps_of(inc)
        assert "holds no CUDA coredump pipe" in steps["cuda_dump"]["error"]
        assert "holds no flight-recorder pipe" in steps["flight_recorder"]["error"]
        # Nothing to capture is not a failure: n/a with the reason, in the incident, the report and the metric.
        assert steps["cuda_dump"]["not_applicable"] and steps["flight_recorder"]["not_applicable"]
        shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir)).stdout
        na = [ln.split() for ln in shown.splitlines() if ln.startswith("    ") and " s" in ln]
        assert {r[0]: r[1] for r in na} == {"flight_recorder": "n/a", "cuda_dump": "n/a"}, shown
        assert "FAILED" not in shown
        for step in ("flight_recorder", "cuda_dump"):
            assert not d.metric("hangwatchd_capture_step_failures_total", step=step)
    finally:
        stop(plain)
    # A FIFO that belongs to another user is never written to.
    work = d.run(gpu_workload("--cuda", "ignore", "--fr", "none", "--beats", "40"), "--heartbeat-timeout", "1")
    try:
        fifo = wait_for(lambda: list((d.runtime_dir / "pipes").glob("cuda_pipe.*")), 10, "the FIFO")[0]
        if os.geteuid() != 0:
            pytest.skip("chown of the FIFO to another uid needs root")
        os.chown(fifo, 12345, 12345)
        incs = wait_for(lambda: [i for i in d.settled() if i["id"] != inc["id"]], 20, "a second incident")
        err = steps_of(incs[0])["cuda_dump"]["error"]
        assert "belongs to uid 12345" in err and "refusing" in err
    finally:
        stop(work)
        d.stop()


def drop_in_pieces(path: Path, blob: bytes, pause: float) -> None:
    with open(path, "wb") as f:
        half = len(blob) // 2
        f.write(blob[:half])
        f.flush()
        time.sleep(pause)
        f.write(blob[half:])


def test_an_exception_dump_becomes_exactly_one_symbolised_incident(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path) as d:
        blob = lzma.decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes())
        name = f"core_{socket.gethostname()}.4242.1795977360.nvcudmp"
        drop_in_pieces(d.dump_dir / name, blob, pause=1.5)
        (inc,) = wait_for(d.settled, 20, "an incident")
        assert inc["reason"] == "gpu-exception"
        assert "WARP_ILLEGAL_ADDRESS in faulty_epilogue_kernel(int*, long) at /srv/gpuapp/inlined.cu:9" in inc["summary"]
        sym = json.loads((Path(inc["dir"]) / "4242" / "symbolized.json").read_text())
        assert [f["line"] for f in sym["exceptions"][0]["frames"]] == [9, 13, 17]
        assert not (d.dump_dir / name).exists()
        assert d.metric("hangwatchd_gpu_exceptions_total", type="WARP_ILLEGAL_ADDRESS") == 1.0
        time.sleep(1)
        assert len(d.store().list()) == 1  # one dump, one incident
        shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir))
        assert "gpu-exception" in shown.stdout


def test_a_driver_that_reports_an_exception_but_writes_no_dump(tmp_path: Path) -> None:
    lines = (FIXTURES / "graph_ima" / "stderr.log").read_text()
    with ScratchDaemon(tmp_path) as d:
        script = f"import sys; sys.stderr.write({lines!r}); sys.exit(1)"
        work = d.run([sys.executable, "-c", script], stderr=subprocess.PIPE)
        _, err = work.communicate(timeout=20)
        assert work.returncode == 1
        assert b"torch.AcceleratorError" in err  # stderr still passes through
        (inc,) = wait_for(d.settled, 20, "an incident")
        assert inc["reason"] == "gpu-exception"
        assert "WARP_ILLEGAL_ADDRESS in void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>" in inc["summary"]
        assert "wrote no dump" in inc["summary"]
        # The program died of the error in Python: the traceback's line is where it surfaced.
        assert "it surfaced in `print(out.sum().item())` (graph_ima.py:33)" in inc["summary"], inc["summary"]
        (pid,) = inc["processes"]
        assert "Detected an exception" in (Path(inc["dir"]) / str(pid) / "driver.log").read_text()


GRAPH_WORKLOAD = """\
import sys
import torch
from torch.cuda.graphs import CUDAGraph

sys.stderr.write(DRIVER)  # what the driver printed when a kernel of the graph faulted
sys.stderr.flush()


class NoGpu:  # no GPU here: the real CUDAGraph.replay runs on a stand-in that has no graph
    _tracker = None


def step():
    try:
        CUDAGraph.replay(NoGpu())
    except TypeError:
        pass


step()
raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch (./dev test installs it)")
def test_a_graph_replay_before_a_cuda_error_is_named_beside_the_line_it_surfaced_in(tmp_path: Path) -> None:
    recorded = (FIXTURES / "graph_ima" / "stderr.log").read_text()
    script = tmp_path / "graph_work.py"
    script.write_text(f"DRIVER = {recorded[:recorded.index('Traceback')]!r}\n" + GRAPH_WORKLOAD)
    replay_line = 1 + script.read_text().splitlines().index("        CUDAGraph.replay(NoGpu())")
    with ScratchDaemon(tmp_path) as d:
        work = d.run([sys.executable, str(script)], stderr=subprocess.PIPE)
        _, err = work.communicate(timeout=60)
        assert work.returncode == 1, err.decode()[-2000:]
        (inc,) = wait_for(d.settled, 20, "an incident")
        assert inc["reason"] == "gpu-exception" and "wrote no dump" in inc["summary"]
        # The error surfaced at the raise; the graph's kernels were launched by the replay before it.
        assert "it surfaced in `raise torch.AcceleratorError(" in inc["summary"], inc["summary"]
        assert (f"after the last replay of a CUDA graph in that thread at `CUDAGraph.replay(NoGpu())` "
                f"(graph_work.py:{replay_line})") in inc["summary"], inc["summary"]
        (pid,) = inc["processes"]
        assert "hangwatchd: the last CUDA graph replay" in (Path(inc["dir"]) / str(pid) / "driver.log").read_text()


def test_a_full_disk_keeps_the_report_and_drops_the_dump(tmp_path: Path) -> None:
    state = tmp_path / "small"
    state.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(state)]).returncode != 0:
        pytest.fail("mount -t tmpfs failed as root")
    try:
        dumps = tmp_path / "dumps"
        d = ScratchDaemon(tmp_path, "--state-dir", str(state), "--dump-dir", str(dumps))
        try:
            free = os.statvfs(state).f_bavail * os.statvfs(state).f_frsize
            (state / "filler").write_bytes(b"\0" * (free - 160 * 1024))
            blob = lzma.decompress((FIXTURES / "torch_ima" / "coredump.nvcudmp.xz").read_bytes())
            drop_in_pieces(dumps / f"core_{socket.gethostname()}.77.1.nvcudmp", blob, pause=0.1)
            def listed() -> list[dict] | None:
                try:
                    return Store(state).list()
                except sqlite3.OperationalError:  # the disk is full for a moment while the dump is compressed
                    return None

            (inc,) = wait_for(listed, 30, "an incident")
            step = steps_of(inc)["cuda_dump"]
            assert "disk is full" in step["error"] and "report is kept" in step["error"]
            assert (Path(inc["dir"]) / "77" / "symbolized.json").exists()
            assert not (Path(inc["dir"]) / "77" / "coredump.nvcudmp.zst").exists()
            assert (dumps / f"core_{socket.gethostname()}.77.1.nvcudmp").exists()  # not deleted: nowhere else to keep it
        finally:
            d.stop()
    finally:
        subprocess.run(["umount", str(state)])


@pytest.mark.parametrize("name", ["TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
def test_the_flight_recorder_dump_is_found_under_either_name(tmp_path: Path, name: str) -> None:
    # PyTorch 2.11 writes where TORCH_FR_DUMP_TEMP_FILE says; older ones where TORCH_NCCL_DEBUG_INFO_TEMP_FILE says.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_", "NCCL_"))}
    env.update({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "trace_"), name: str(tmp_path / "dump_"), "RANK": "0",
                "HANGWATCHD_RUNTIME_DIR": str(tmp_path / "run")})
    work = subprocess.Popen(gpu_workload("--cuda", "none", "--beats", "0"), env=env, stdout=subprocess.PIPE)
    try:
        assert work.stdout is not None and work.stdout.readline() == b"stopped beating\n"  # its FIFO is open
        (tmp_path / "c.toml").write_text('capture_steps = ["flight_recorder"]\n')
        res = hangwatchd("capture", str(work.pid), "--json", "--config", str(tmp_path / "c.toml"), "--state-dir", str(tmp_path / "s"))
        assert res.returncode == 0, res.stderr
        (inc,) = Store(tmp_path / "s").list()
        assert steps_of(inc)["flight_recorder"]["ok"], steps_of(inc)
        assert (Path(inc["dir"]) / str(work.pid) / "flight-recorder.pkl").stat().st_size > 0
    finally:
        stop(work)


def test_a_wait_for_a_file_ends_when_its_writer_is_gone(tmp_path: Path) -> None:
    """A flight-recorder trace or a GPU dump is written by the process itself: once it is gone with
    nothing written, the capture stops waiting (seen on an H200: a rank's GPU dump ended it, and its
    trace was waited for until the step's whole deadline); what it wrote before it went still counts."""
    from hangwatchd.capture.waitfile import Watch

    for writes in (False, True):
        out = tmp_path / ("wrote" if writes else "silent")
        out.mkdir()
        watch = Watch(out, "trace_*")
        code = f"import time; time.sleep(0.5); open({str(out / 'trace_0')!r}, 'w').write('x')" if writes else "import time; time.sleep(0.5)"
        writer = subprocess.Popen([sys.executable, "-c", code])
        try:
            start = time.monotonic()
            found = watch.wait(120.0, lambda: writer.poll() is not None)  # noqa: B023 - waited for here, in this turn
            waited = time.monotonic() - start
        finally:
            writer.wait(30)
            watch.close()
        assert waited < 60.0, "it waited out its whole deadline for a writer that was gone"
        assert found == (out / "trace_0" if writes else None)


def test_nvml_said_absent_is_not_asked_again_for_a_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the probe says NVML is not here, the step says n/a without starting another probe (50
    hangs at once started 50 interpreters to hear it) for ``ABSENT_FOR``; then it asks again."""
    from hangwatchd.capture.base import StepNotApplicable
    from hangwatchd.capture.nvml import NvmlStep
    from hangwatchd.host import procfs
    from hangwatchd.host.deadline import Deadline
    from hangwatchd.model import Registration

    fake = Path(__file__).parent / "fake_nvml"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.delenv("HANGWATCHD_FAKE_NVML", raising=False)  # the stand-in then says: no NVML library
    me = procfs.identify(os.getpid())
    assert me is not None
    target = Registration(me, uid=os.getuid())
    step = NvmlStep()
    with pytest.raises(StepNotApplicable) as first:
        step.run(target, tmp_path, Deadline.after(30.0))
    # A GPU now answers; the step does not ask yet, and says what it was told.
    gpus = tmp_path / "nvml"
    (gpus / "events").mkdir(parents=True)
    (gpus / "gpus").write_text("2")
    monkeypatch.setenv("HANGWATCHD_FAKE_NVML", str(gpus))
    with pytest.raises(StepNotApplicable) as again:
        step.run(target, tmp_path, Deadline.after(30.0))
    assert str(again.value) == str(first.value) and not (tmp_path / "nvml.json").exists()
    assert step.absent is not None
    step.absent = (time.monotonic() - 1.0, step.absent[1])  # its time is up: asked again, and the GPUs are there
    assert step.run(target, tmp_path, Deadline.after(30.0)) == ("nvml.json",)
    assert len(json.loads((tmp_path / "nvml.json").read_text())["devices"]) == 2
