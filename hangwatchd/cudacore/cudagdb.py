"""Optional cross-check: what cuda-gdb says about the same dump, where it is installed."""

from __future__ import annotations

import os

from ..host import subproc
from .source import raw_path

DEADLINE_S = 60.0


def find_cuda_gdb() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return subproc.find_tool("cuda-gdb", "HANGWATCHD_CUDA_GDB", [os.path.join(home, "bin", "cuda-gdb")])


def cuda_gdb_argv(tool: str, dump: str) -> list[str]:
    return [tool, "--batch", "-ex", f"target cudacore {dump}", "-ex", "info cuda kernels", "-ex", "bt"]


def cross_check(path: str | os.PathLike[str]) -> str:
    """cuda-gdb's answer as text, or one line saying why there is none."""
    tool = find_cuda_gdb()
    if tool is None:
        return "cuda-gdb is not installed here (it is optional: everything above came without it)"
    with raw_path(path) as raw:
        res = subproc.run(cuda_gdb_argv(tool, raw), timeout=DEADLINE_S)
    if res.timed_out:
        return f"cuda-gdb took longer than {DEADLINE_S:.0f} s and was stopped"
    return (res.stdout + res.stderr).decode("utf-8", "replace").strip()
