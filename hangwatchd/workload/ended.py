"""The daemon's word that it ended a process (on_hang = "abort"), for ``hangwatchd run`` to read.

``hangwatchd run`` is the workload's parent and learns only an exit status: a
SIGABRT or SIGKILL from the daemon would look like any other death. Before it
signals, the daemon writes ``RUNTIME_DIR/ended/PID-START.json`` naming the
incident; the dir is the daemon's own (owned like the runtime dir, writable by
nobody else), so a record there is believed and one anywhere else never is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..host import untrusted
from ..model import ProcessId

DIR = "ended"
MAX_FILE = 4096


@dataclass(frozen=True)
class Ended:
    """The daemon ended this process after storing ``incident``."""

    incident: str
    action: str
    time: float


def path_of(runtime_dir: Path, process: ProcessId) -> Path:
    return runtime_dir / DIR / f"{process.pid}-{process.start_time}.json"


def read(runtime_dir: Path, process: ProcessId) -> Ended | None:
    """The daemon's record for ``process``, or None (none, or not from the daemon's own dir)."""
    d = runtime_dir / DIR
    try:
        top, st = os.stat(runtime_dir), os.lstat(d)
    except OSError:
        return None
    if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != top.st_uid or st.st_mode & 0o022:
        return None
    try:
        data = json.loads(untrusted.read_bytes(path_of(runtime_dir, process), st.st_uid, MAX_FILE, 1.0))
    except (untrusted.Refused, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("incident"), str):
        return None
    when = data.get("time")
    return Ended(data["incident"][:200], "abort", float(when) if isinstance(when, (int, float)) else 0.0)
