"""A raw CUDA coredump in a process directory that has no ``symbolized.json``: symbolised for the analysis.

A directory put together by hand (or copied from a node without the daemon's
report) may hold the dump alone, raw or compressed. It is read as any untrusted
dump is: opened once without following links, a regular file within the size
cap, symbolised in the sandbox's limited child (CPU, memory and wall-clock
limits; its decompression bounded there too). What cannot be read becomes one
line in the analysis's list of what could not be read, never an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..cudacore import sandbox
from ..cudacore.errors import CoreDumpError
from ..host import untrusted

NAMES = ("coredump.nvcudmp", "coredump.nvcudmp.zst", "coredump.nvcudmp.xz", "coredump.nvcudmp.gz")
MAX_FILE = 64 << 30  # as for a dump the daemon reads (capture.dump_artifacts.MAX_DUMP)


def find(pdir: Path) -> Path | None:
    """The process directory's raw dump, by its one of ``NAMES`` (the first present)."""
    return next((pdir / n for n in NAMES if os.path.lexists(pdir / n)), None)


def symbolized(pdir: Path, limits: sandbox.Limits | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(the dump symbolised, as symbolized.json would hold it; or why not, in one line). (None, None)
    where the directory holds no dump."""
    path = find(pdir)
    if path is None:
        return None, None
    label = f"{pdir.name}/{path.name}"
    try:
        fd = untrusted.open_fd(path, None, max_size=MAX_FILE)
    except untrusted.Refused as exc:
        return None, f"{label}: not symbolised ({exc})"
    try:
        result = sandbox.symbolize(untrusted.fd_path(fd), limits)
    except CoreDumpError as exc:
        return None, f"{label}: not symbolised ({str(exc).replace(untrusted.fd_path(fd), path.name)})"
    finally:
        os.close(fd)
    data = json.loads(json.dumps(result.to_dict()))  # as symbolized.json would read back: lists, not tuples
    data["path"] = str(path)
    return data, None
