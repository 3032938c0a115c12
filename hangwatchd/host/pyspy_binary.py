"""The py-spy program on this host: where it is, and what keeps it from reading a process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import subproc


def find_pyspy() -> str | None:
    """$HANGWATCHD_PYSPY ('none' to go without), py-spy on PATH, or beside the Python running us (a virtualenv's bin)."""
    return subproc.find_tool("py-spy", "HANGWATCHD_PYSPY", [str(Path(sys.executable).parent / "py-spy")])


def ptrace_hint() -> str:
    """Exactly what stands in the way of reading another process's memory."""
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        scope = None
    if os.geteuid() != 0:
        return ("run hangwatchd as root or as the workload's user with CAP_SYS_PTRACE"
                + (f" (kernel.yama.ptrace_scope={scope})" if scope else ""))
    if scope == "3":
        return "kernel.yama.ptrace_scope=3 forbids ptrace even for root; set it to 1 or lower"
    return "give hangwatchd CAP_SYS_PTRACE (in a container: securityContext.capabilities.add: [SYS_PTRACE])"
