"""A GPU exception caught alive: the driver's dump goes to the daemon's FIFO for the process, the
stacks are taken while the writer waits, then the dump is drained into the one incident.

The driver's part is played by a real child process (tests/gpufault: ``fakecuda`` writes a real
fixture dump into the FIFO the daemon made for it, from the thread that "synchronises", whole,
slowly, half, or not at all), started by ``hangwatchd run`` as a workload would be.
"""

from __future__ import annotations

import importlib.util
import json
import lzma
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatchd.testing import ScratchDaemon, stop, wait_for
from hangwatchd.workload import runtime_files

from .conftest import FIXTURES, hangwatchd
from .test_security import NOBODY, QUICK, SYSTEM_PYTHON, Attacker, attacker, base, needs_root  # noqa: F401 - fixtures (base, attacker)
from .test_security_paths import VICTIM, user_env

HERE = Path(__file__).parent / "gpufault"
ROOT = Path(__file__).resolve().parents[1]
DUMP = FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz"


def fault(d: ScratchDaemon, script: str, mode: str, tmp: Path, *options: str, dump: Path = DUMP,
          pause: float = 0.1, job: str | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=f"{HERE / 'site-packages'}{os.pathsep}{ROOT}", FAKECUDA_MODE=mode,
               FAKECUDA_DUMP=str(dump), FAKECUDA_MOMENTS=str(tmp / "moments"), FAKECUDA_PAUSE=str(pause))
    return d.run([sys.executable, str(HERE / script)], "--job", job or f"fault-{mode}", "--heartbeat-timeout", "2", *options,
                 env=env, stderr=subprocess.PIPE)


def watched(d: ScratchDaemon) -> list[dict[str, Any]]:
    """The daemon's status.json rows: every process it watches."""
    rows: list[dict[str, Any]] = (runtime_files.status(d.runtime_dir) or {}).get("processes") or []
    return rows


def incident_json(inc: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((Path(inc["dir"]) / "incident.json").read_text())
    return data


def steps(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["step"]: s for s in data["processes"][0]["steps"]}


def main_frames(pdir: Path, thread: str = "MainThread") -> list[str]:
    stacks = json.loads((pdir / "pyspy.json").read_text())
    t = next(t for t in stacks if t.get("thread_name") == thread)
    return [f"{f['name']}:{Path(f['filename']).name}:{f['line']}" for f in t["frames"]]


def test_an_exception_is_one_incident_with_the_stacks_taken_while_the_driver_waits(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path / "d") as d:
        work = fault(d, "illegal_address.py", "whole", tmp_path)
        try:
            (inc,) = wait_for(d.settled, 40, "the exception's incident")
            _, err = work.communicate(timeout=20)
            assert work.returncode == 134, err  # the driver's abort, once its dump was read
        finally:
            stop(work)
        data = incident_json(inc)
        assert data["reason"] == "gpu-exception" and data["job"] == "fault-whole"
        pid = data["processes"][0]["pid"]
        pdir = Path(inc["dir"]) / str(pid)
        s = steps(data)
        assert list(s) == ["proc", "pyspy", "introspect", "cuda_exception"], s
        assert s["cuda_exception"]["ok"] and s["cuda_exception"]["error"] is None, s["cuda_exception"]
        # Taken while the driver's thread was still writing: the main thread is in item() at the program's line.
        assert main_frames(pdir)[-2:] == ["Tensor.item:fakecuda.py:39", "<module>:illegal_address.py:12"], main_frames(pdir)
        sym = json.loads((pdir / "symbolized.json").read_text())
        assert [f["line"] for f in sym["exceptions"][0]["frames"]] == [9, 13, 17]
        raw = lzma.decompress(DUMP.read_bytes())
        with open(pdir / "coredump.nvcudmp.zst", "rb") as f:
            assert zstandard.ZstdDecompressor().stream_reader(f).read() == raw
        verdict = data["verdict"]
        assert verdict.startswith(f"pid {pid}: WARP_ILLEGAL_ADDRESS in faulty_epilogue_kernel(int*, long) at "
                                  "store_at(int*, long, int) (inlined.cu:9) ← epilogue(int*, long, int) (inlined.cu:13) ← "
                                  "faulty_epilogue_kernel(int*, long) (inlined.cu:17), surfaced in `print(data.item())` (illegal_address.py:12)"), verdict
        assert "asynchronous launches" in verdict
        assert d.metric("hangwatchd_gpu_exceptions_total", type="WARP_ILLEGAL_ADDRESS") == 1.0
        shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir))
        assert shown.returncode == 0 and "surfaced in `print(data.item())`" in shown.stdout, shown.stdout + shown.stderr
        assert "cuda_exception" in shown.stdout and "print(data.item())" in (Path(inc["dir"]) / "report.html").read_text()
        d.event("process_forgotten", pid=pid)
        assert not list((d.dump_dir / "exceptions").glob("*/*")), "the FIFO outlived its process"


def test_a_slow_driver_past_the_heartbeat_timeout_is_still_one_incident(tmp_path: Path) -> None:
    """The beats stop while the driver writes (4 s, the timeout is 2 s): the exception is the process's
    one incident, never a second one for a hang."""
    with ScratchDaemon(tmp_path / "d") as d:
        work = fault(d, "illegal_address.py", "slow", tmp_path, pause=0.25)
        try:
            (inc,) = wait_for(d.settled, 40, "the exception's incident")
            work.communicate(timeout=30)
        finally:
            stop(work)
        data = incident_json(inc)
        pid = data["processes"][0]["pid"]
        assert data["reason"] == "gpu-exception" and steps(data)["cuda_exception"]["ok"], data
        assert "surfaced in `print(data.item())` (illegal_address.py:12)" in data["verdict"]
        d.event("process_forgotten", pid=pid, seconds=20)
        assert [i["reason"] for i in d.store().list()] == ["gpu-exception"]
        assert not d.metric_total("hangwatchd_incidents_total", reason="heartbeat")


def test_the_python_line_of_the_thread_that_met_the_fault_and_a_graphs_replay(tmp_path: Path) -> None:
    """The error surfaces in a thread of the program's (its model runner), not in the main thread that
    waits for its output; and inside a CUDA graph's replay, named as such."""
    (tmp_path / "g").mkdir()
    with ScratchDaemon(tmp_path / "d") as d:
        model = fault(d, "model_thread.py", "whole", tmp_path, job="model")
        graph = fault(d, "graph_replay.py", "whole", tmp_path / "g", job="graph")
        try:
            wait_for(lambda: len(d.settled()) == 2, 40, "both exceptions' incidents")
        finally:
            stop(model, graph)
        verdict = {i["job"]: incident_json(i)["verdict"] for i in d.settled()}
        assert "WARP_ILLEGAL_ADDRESS in faulty_epilogue_kernel(int*, long)" in verdict["model"]
        assert ("surfaced in thread model-runner at `outputs.put(fakecuda.Tensor().item())` (model_thread.py:15)"
                in verdict["model"]), verdict["model"]
        assert "surfaced in the replay of a CUDA graph at `g.replay()` (graph_replay.py:12)" in verdict["graph"], verdict["graph"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch (./dev test installs it)")
def test_a_graph_replayed_before_the_sync_the_error_surfaced_in_is_named_from_the_processs_own_word(tmp_path: Path) -> None:
    """No stack holds the replay once it returned; the process's reporter noted it, and the capture
    asks it while the driver waits."""
    with ScratchDaemon(tmp_path / "d") as d:
        work = fault(d, "graph_then_sync.py", "whole", tmp_path)
        try:
            (inc,) = wait_for(d.settled, 40, "the exception's incident")
        finally:
            stop(work)
        data = incident_json(inc)
        assert steps(data)["introspect"]["ok"], steps(data)
        assert ("surfaced in `print(fakecuda.Tensor().item())` (graph_then_sync.py:23), after the last replay of a CUDA graph "
                "in that thread at `CUDAGraph.replay(NoGpu())` (graph_then_sync.py:20)") in data["verdict"], data["verdict"]


@pytest.mark.parametrize("mode, config, said", [
    ("half", {}, "its writer ended after 143493 bytes of the 286986 its header gives"),
    ("stall", {"capture_timeout": 3.0, "gpu_dump_timeout": 2.0},
     "the driver did not finish writing by the capture's deadline: 143493 bytes of the 286986 its header gives came"),
    ("whole", {"exception_dump_max_bytes": 100000}, "the dump passed the cap of 100000 bytes (exception_dump_max_bytes)"),
])
def test_a_writer_that_dies_stalls_or_passes_the_cap_ends_with_its_line_in_the_incident(
        tmp_path: Path, mode: str, config: dict[str, Any], said: str) -> None:
    with ScratchDaemon(tmp_path / "d", config=config) as d:
        work = fault(d, "illegal_address.py", mode, tmp_path)
        try:
            (inc,) = wait_for(d.settled, 40, "the exception's incident")
        finally:
            stop(work)
        data = incident_json(inc)
        s = steps(data)
        assert s["pyspy"]["ok"], s  # the stacks came first, whatever the dump did after
        assert "<module>:illegal_address.py:12" in main_frames(Path(inc["dir"]) / str(data["processes"][0]["pid"]))
        assert not s["cuda_exception"]["ok"] and said in s["cuda_exception"]["error"], s["cuda_exception"]
        assert said in data["detail"] or said in json.dumps(data["processes"])
        # No exception could be read from what came: the verdict says so, and where it surfaced.
        assert data["verdict"].startswith(f"pid {data['processes'][0]['pid']}: GPU exception (core."), data["verdict"]
        assert data["verdict"].endswith("surfaced in `print(data.item())` (illegal_address.py:12)."), data["verdict"]
        # What came is kept, compressed, for whoever wants to look at it.
        assert "coredump.nvcudmp.zst" in s["cuda_exception"]["files"], s["cuda_exception"]


def test_a_fifo_never_written_holds_nothing_up_and_junk_from_its_owner_is_named(tmp_path: Path) -> None:
    """The driver opens the FIFO and writes nothing: the process then hangs like any other, and its
    hang is captured. Another process of the user writes junk into a healthy process's FIFO: one
    incident says what came, the process is not paused for it, and goes on as healthy."""
    with ScratchDaemon(tmp_path / "d") as d:
        never = fault(d, "illegal_address.py", "never", tmp_path, job="never")
        healthy = d.run([sys.executable, "-m", "hangwatchd.testing", "workload", "--beats", "100000", "--interval", "0.05"],
                        "--job", "healthy", "--heartbeat-timeout", "2")
        try:
            (hang,) = wait_for(lambda: [i for i in d.settled() if i["job"] == "never"], 40, "the never-written hang's incident")
            assert hang["reason"] == "heartbeat", hang
            pid = wait_for(lambda: next((p["pid"] for p in watched(d) if p["job"] == "healthy"), None), 20, "the healthy one watched")
            fifo = d.dump_dir / "exceptions" / str(os.getuid()) / f"core.{pid}.nvcudmp"
            assert stat.S_ISFIFO(os.stat(fifo).st_mode)
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"not a dump" * 100)
            os.close(fd)
            (junk,) = wait_for(lambda: [i for i in d.settled() if i["job"] == "healthy"], 20, "the junk's incident")
            data = incident_json(junk)
            assert list(steps(data)) == ["cuda_exception"]  # no stacks taken for it
            assert "not a CUDA coredump" in steps(data)["cuda_exception"]["error"]
            assert not d.metric_total("hangwatchd_gpu_exceptions_total", type="WARP_ILLEGAL_ADDRESS")
            d.looked(10)
            assert next(p for p in watched(d) if p["pid"] == pid)["state"] == "healthy"
            assert healthy.poll() is None
        finally:
            stop(never, healthy)


PROBE = """
import json, os, stat, sys
p = os.environ.get("CUDA_COREDUMP_FILE", "")
path = p.replace("%p", str(os.getpid()))
try:
    st = os.stat(path)
    seen = {"fifo": stat.S_ISFIFO(st.st_mode), "mode": oct(stat.S_IMODE(st.st_mode)), "uid": st.st_uid}
except OSError as exc:
    seen = {"error": exc.strerror}
print(json.dumps({"pattern": p, "pipe": os.environ.get("CUDA_COREDUMP_PIPE"), "pid": os.getpid(), **seen}), flush=True)
"""


def probe(d: ScratchDaemon | None, runtime: Path, **env: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "hangwatchd", "run", "--runtime-dir", str(runtime), "--", sys.executable, "-c", PROBE]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr
    seen: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return seen


def test_the_fifo_is_there_before_the_workload_starts_and_goes_with_it(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path / "d") as d:
        seen = probe(d, d.runtime_dir)
        root = d.dump_dir / "exceptions"
        assert seen["pattern"] == f"{root}/{os.getuid()}/core.%p.nvcudmp", seen
        # Made before the program's first line: a FIFO of the user's, nobody else's to open.
        assert seen["fifo"] and seen["mode"] == "0o600" and seen["uid"] == os.getuid(), seen
        assert seen["pipe"] and seen["pipe"].endswith("cuda_pipe.%p")  # the triggered dump's pipe as before
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o711 and stat.S_IMODE(os.stat(root / str(os.getuid())).st_mode) == 0o711
        d.event("process_forgotten", pid=seen["pid"])
        wait_for(lambda: not (root / str(os.getuid()) / f"core.{seen['pid']}.nvcudmp").exists(), 10, "the FIFO removed")
        # A file of the user's own choosing stays theirs.
        mine = probe(d, d.runtime_dir, CUDA_COREDUMP_FILE=str(tmp_path / "mine.%p"))
        assert mine["pattern"] == str(tmp_path / "mine.%p") and mine.get("error"), mine
        # Held while the daemon runs, removed when it stops: a fault while no daemon runs ends the
        # process as it would have, never with a driver waiting for a reader that is not there.
        work = d.run([sys.executable, "-m", "hangwatchd.testing", "workload", "--beats", "100000"], "--heartbeat-timeout", "60")
        try:
            wait_for(lambda: list((root / str(os.getuid())).iterdir()), 20, "the workload's FIFO")
            d.stop()
            assert not list((root / str(os.getuid())).iterdir())
        finally:
            stop(work)
    # No daemon: the dumps are files in the dump dir, as before.
    alone = probe(None, tmp_path / "nodaemon")
    assert "exceptions" not in alone["pattern"] and alone["pattern"].endswith("core_%h.%p.%t.nvcudmp".replace("%h", os.uname().nodename)), alone


@needs_root
def test_other_users_can_neither_open_replace_nor_plant_a_fifo(base: Path, attacker: Attacker) -> None:
    """As root, with a workload of a second user (VICTIM) and uid 65534 as the attacker: a link the
    attacker planted where the FIFOs' directory goes is moved aside, never followed; the attacker
    can neither list, open (to read or write), remove nor replace the victim's FIFO, nor make one;
    the victim's exception is caught alive all the same."""
    dumps = base / "state-dumps"
    dumps.mkdir()
    os.chmod(dumps, 0o1777)
    target = base / "target"
    target.mkdir()
    os.chmod(target, 0o777)
    attacker.run(f"import os; os.symlink({str(target)!r}, {str(dumps / 'exceptions')!r})")
    with ScratchDaemon(base, config=QUICK) as d:
        root = dumps / "exceptions"
        assert not root.is_symlink() and root.stat().st_uid == 0 and stat.S_IMODE(root.stat().st_mode) == 0o711
        (aside,) = [p for p in dumps.iterdir() if p.name.startswith(".exceptions-planted-")]
        assert aside.is_symlink() and not list(target.iterdir())  # moved, never followed
        aside.unlink()
        env = dict(user_env(), PYTHONPATH=f"{HERE / 'site-packages'}{os.pathsep}{user_env()['PYTHONPATH']}",
                   FAKECUDA_MODE="slow", FAKECUDA_PAUSE="0.5", FAKECUDA_DUMP=str(base / "dump.xz"))
        shutil.copy(DUMP, base / "dump.xz")
        os.chmod(base / "dump.xz", 0o644)
        victim = attacker.spawn([SYSTEM_PYTHON, "-m", "hangwatchd", "run", "--runtime-dir", str(d.runtime_dir), "--job", "v",
                                 "--heartbeat-timeout", "5", "--", SYSTEM_PYTHON, str(HERE / "illegal_address.py")],
                                user=VICTIM, group=VICTIM, extra_groups=[], cwd="/", env=env, stderr=subprocess.PIPE)
        fifo = wait_for(lambda: next(iter((root / str(VICTIM)).glob("core.*.nvcudmp")), None)
                        if (root / str(VICTIM)).exists() else None, 20, "the victim's FIFO")
        assert fifo.stat().st_uid == VICTIM and stat.S_IMODE(fifo.stat().st_mode) == 0o600
        tried = json.loads(attacker.run(f"""
import json, os
fifo, d, mine = {str(fifo)!r}, {str(root / str(VICTIM))!r}, {str(target / "mine")!r}
open(mine, "w").close()
out = {{}}
for what, act in [("list", lambda: os.listdir(d)), ("list_root", lambda: os.listdir({str(root)!r})),
                  ("read", lambda: os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)),
                  ("write", lambda: os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)),
                  ("unlink", lambda: os.unlink(fifo)), ("replace", lambda: os.rename(mine, fifo)),
                  ("mkfifo", lambda: os.mkfifo(d + "/core.1.nvcudmp")), ("link", lambda: os.symlink("/etc/shadow", d + "/x"))]:
    try:
        act()
        out[what] = "done"
    except OSError as exc:
        out[what] = exc.strerror
print(json.dumps(out))
"""))
        assert set(tried.values()) == {"Permission denied"}, tried
        (inc,) = wait_for(lambda: [i for i in d.settled() if i["job"] == "v"], 60, "the victim's exception")
        data = incident_json(inc)
        assert data["processes"][0]["pid"] == int(fifo.name.split(".")[1]) and steps(data)["cuda_exception"]["ok"], data
        assert "surfaced in `print(data.item())` (illegal_address.py:12)" in data["verdict"], data["verdict"]
        victim.wait(timeout=30)


@needs_root
def test_the_quoted_line_is_read_with_the_process_users_rights_only(base: Path, attacker: Attacker) -> None:
    """A frame may name any file (a user's program can claim to be /etc/shadow): its line is read by a
    helper running as the process's user, so a file that user cannot read is never quoted."""
    from hangwatchd.host import source_lines
    from hangwatchd.host.deadline import Deadline

    secret = base / "secret.py"
    secret.write_text("root_only = 1\n")
    os.chmod(secret, 0o600)
    public = base / "public.py"
    public.write_text("import os\nprint(data[index])  # here\n")
    os.chmod(public, 0o644)
    wanted = [(str(secret), 1), (str(public), 2), ("<string>", 1), (str(public), 99)]
    theirs = attacker.spawn(["sleep", "60"], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/")  # the process named
    lines = source_lines.read(theirs.pid, NOBODY, wanted, Deadline.after(5).at)
    assert lines == [{"file": str(public), "line": 2, "code": "print(data[index])  # here"}], lines
    assert source_lines.read(os.getpid(), 0, wanted[:1], Deadline.after(5).at)[0]["code"] == "root_only = 1"


@needs_root
def test_a_worker_process_that_never_registered_gets_its_fifo_as_it_starts(tmp_path: Path) -> None:
    """A program started below a workload of hangwatchd run's (a rank under torchrun, an engine's worker)
    inherits the FIFO pattern but registers nothing: the daemon, told by the kernel's process events,
    makes its FIFO as it starts, and its exception is caught alive, filed under the workload's job."""
    with ScratchDaemon(tmp_path / "d") as d:
        work = fault(d, "spawns_worker.py", "whole", tmp_path, job="spawner")
        try:
            (inc,) = wait_for(d.settled, 40, "the worker's exception")
        finally:
            stop(work)
        data = incident_json(inc)
        assert data["reason"] == "gpu-exception" and data["job"] == "spawner", data
        assert steps(data)["cuda_exception"]["ok"], steps(data)
        assert "surfaced in `fakecuda.Tensor().item()` (worker.py:7)" in data["verdict"], data["verdict"]


# -- the parsers of what a user's process writes (any bytes) ----------------------------------

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_first_bytes_are_told_apart_from_a_coredump_without_an_error(head: bytes) -> None:
    from hangwatchd.host.dump_fifos import HEADER, header_facts

    coredump, expected, why = header_facts(head)
    assert coredump == (why is None)
    if coredump:
        assert len(head) >= HEADER and head[:4] == b"\x7fELF" and (expected is None or expected > 0)
    else:
        assert expected is None and why


def test_the_real_headers_give_the_real_sizes() -> None:
    from hangwatchd.host.dump_fifos import header_facts

    for name in ("cpp_ima", "torch_ima", "triton_hang", "cpp_hang"):
        raw = lzma.decompress((FIXTURES / name / "coredump.nvcudmp.xz").read_bytes())
        assert header_facts(raw[:64]) == (True, len(raw), None), name


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=64, max_size=20000), st.lists(st.integers(1, 5000), max_size=20), st.integers(10, 30000))
def test_a_drain_keeps_exactly_what_came_up_to_its_cap(data: bytes, cuts: list[int], cap: int) -> None:
    """Bytes written into a pipe in any pieces come out whole, in order, cut at the cap, never past it."""
    import tempfile

    from hangwatchd.host.dump_fifos import Drain

    r, w = os.pipe2(os.O_NONBLOCK)
    fcntl_size = 1 << 16
    with tempfile.TemporaryFile() as out:
        drain = Drain(out.fileno(), cap, expected=len(data))
        at = 0
        for cut in [*cuts, len(data)]:
            piece = data[at:at + min(cut, fcntl_size)]
            at += len(piece)
            if piece:
                os.write(w, piece)
            drain.feed(r)
            if drain.ended:
                break
        os.close(w)
        if not drain.ended:
            drain.writer_gone(r)
        os.close(r)
        out.seek(0)
        kept = out.read()
    assert kept == data[:len(kept)] and len(kept) == drain.size <= cap
    assert drain.ended == ("cap" if len(data) >= cap else "whole" if at >= len(data) else "short"), (drain.ended, len(data), cap, at)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_line_of_code_loses_its_comment_without_an_error(line: str) -> None:
    from hangwatchd.analyze.surfaced import without_comment

    out = without_comment(line)
    assert "\n" not in out.strip() or "\n" in line
