"""Reading captured stacks: is the hung process waiting on the GPU? (The real py-spy output of a hung H200 job.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hangwatchd.analyze.stacks import gpu_wait

from .conftest import FIXTURES


def test_the_hung_triton_job_waits_in_custreamsynchronize(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "triton_hang" / "pyspy-native.json", tmp_path)
    assert gpu_wait(tmp_path) == "cuStreamSynchronize"


def test_a_thread_stuck_anywhere_in_libcuda_counts(tmp_path: Path) -> None:
    stack: list[dict[str, Any]] = [{"frames": [{"name": "0x7f00", "short_filename": "libcuda.so.580.159.04"},
                         {"name": "cuLaunchKernel", "short_filename": "libcuda.so.580.159.04"},
                         {"name": "main", "filename": "train.py", "line": 3}]}]
    (tmp_path / "pyspy-native.json").write_text(json.dumps(stack))
    assert gpu_wait(tmp_path) == "cuLaunchKernel"  # the named driver call says most
    stack[0]["frames"][1]["name"] = "0x7f10"  # no symbol at all: the library alone counts
    (tmp_path / "pyspy-native.json").write_text(json.dumps(stack))
    assert gpu_wait(tmp_path) == "0x7f00 (libcuda.so.580.159.04)"


def test_python_stacks_without_native_frames_do_not_confirm(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "triton_hang" / "pyspy.json", tmp_path)
    assert gpu_wait(tmp_path) is None
    assert gpu_wait(tmp_path / "nothing-here") is None
