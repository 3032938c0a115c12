"""A native frame py-spy cannot name, in a process of another mount namespace, is named through
the process's own root (/proc/PID/root), and never taken for the user's code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangwatchd.detect.patterns import is_user_frame
from hangwatchd.host import native_frames
from hangwatchd.host.pyspy_binary import find_pyspy
from hangwatchd.testing import stop, wait_for

from .conftest import needs_root


def test_an_unnamed_native_frame_is_nobodys_code() -> None:
    assert not is_user_frame({"name": "0x4ce7c3", "filename": "?", "module": None, "short_filename": "?"})
    assert is_user_frame({"name": "train_step", "filename": "/home/u/train.py", "module": None})


@needs_root  # a mount namespace and a tmpfs of its own
def test_a_binary_only_the_other_namespace_holds_is_named_through_its_root(tmp_path: Path) -> None:
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if not python.exists() or shutil.which("unshare") is None:
        pytest.skip("needs the interpreter's binary and unshare(1)")
    job = tmp_path / "job"
    job.mkdir()
    # In our namespace the path holds another file: what is read must be the mapped one.
    (job / "python").write_bytes(b"not the interpreter")
    script = (f"mount -t tmpfs tmpfs {job} && cp {python} {job}/python && exec {job}/python -c "
              "'import select; print(1, flush=True); select.select([], [], [], 120)'")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"1"
        wait_for(lambda: "select" in Path(f"/proc/{proc.pid}/wchan").read_text()
                 or Path(f"/proc/{proc.pid}/stat").read_text().split()[2] == "S", 10, "the child to block")
        res = subprocess.run([find_pyspy() or "py-spy", "dump", "--native", "--json", "--pid", str(proc.pid)],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        threads = json.loads(res.stdout)
        frames = threads[0]["frames"]
        if not any(f["filename"] == "?" for f in frames):
            pytest.skip("py-spy named every frame here: nothing for hangwatchd to resolve")
        assert native_frames.name_unknown_frames(proc.pid, threads, time.monotonic() + 10) >= 1
        named = [f for f in frames if f.get("resolved_by")]
        assert named and all(f["module"] == f"{job}/python" and f["short_filename"] == "python" for f in named)
        assert not any(is_user_frame(f) for f in named)
        assert not any(f["filename"] == "?" for f in frames)
    finally:
        stop(proc)
