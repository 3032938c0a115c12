"""What the GPU dump files a workload leaves are called: the names ``hangwatchd run`` asks the
driver for, and the pid each name carries. The launcher sets them; the daemon reads them back."""

from __future__ import annotations

import re
import socket

# hangwatchd run sets CUDA_COREDUMP_FILE to DUMP_DIR/core_%h.%p.%t.nvcudmp
NAME_PATTERN = "core_%h.%p.%t.nvcudmp"
_NAME = re.compile(r"^core_(?P<host>.+)\.(?P<pid>\d+)\.(?P<time>\d+)\.nvcudmp$")
DRIVER_LOG_SUFFIX = ".driver-log"  # the launcher's record of coredump: lines that came with no dump


def pid_of(name: str) -> int | None:
    """The pid a dump file name carries (our naming, or the driver's default core_T_HOST_PID.nvcudmp)."""
    m = _NAME.match(name)
    if m:
        return int(m.group("pid"))
    m = re.match(r"^core_\d+_.+_(\d+)\.nvcudmp$", name)
    if m:
        return int(m.group(1))
    m = re.match(r"^nodump_.+\.(\d+)\.\d+" + re.escape(DRIVER_LOG_SUFFIX) + "$", name)
    return int(m.group(1)) if m else None


def expand(pattern: str, pid: int) -> str:
    """A CUDA_COREDUMP_FILE pattern as a glob for this pid (%t is only known once written)."""
    return pattern.replace("%h", socket.gethostname()).replace("%p", str(pid)).replace("%t", "*")
