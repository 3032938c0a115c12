"""The files a running daemon keeps in its runtime dir for clients and the CLI to read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..host import procfs
from ..host.atomic import write_atomic

DAEMON_FILE = "daemon.json"  # who the daemon is and where it keeps things
STATUS_FILE = "status.json"  # every watched process, rewritten on each change
DRIVER_LOGS = "driver-logs"  # the daemon's directory (0755): in it one of each user's, made by the daemon, owned by the user


def driver_log(logs: Path, uid: int, pid: int) -> Path:
    """Where ``hangwatchd run`` keeps the CUDA driver's lines of its workload ``pid`` of ``uid``
    (``logs``: RUNTIME_DIR/driver-logs): in that user's own directory, so no other user can take
    the name first."""
    return logs / str(uid) / f"{pid}.log"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    write_atomic(path, json.dumps(data, indent=1, default=str).encode())


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def daemon_info(runtime_dir: Path) -> dict[str, Any] | None:
    """daemon.json of a daemon that is running now (checked against /proc), else None."""
    info = _read(runtime_dir / DAEMON_FILE)
    if info is None:
        return None
    try:
        pid, started = int(info.get("pid") or 0), int(info.get("start_time") or 0)
    except (TypeError, ValueError):
        return None
    return info if procfs.running(pid, started) else None


def status(runtime_dir: Path) -> dict[str, Any] | None:
    """What a running daemon last wrote about its processes; None when no daemon runs."""
    info = daemon_info(runtime_dir)
    data = _read(runtime_dir / STATUS_FILE) if info else None
    if data is None:
        return None
    data["daemon"] = info
    return data


def status_written(runtime_dir: Path) -> float | None:
    """When status.json was last written (its own time), whether or not its daemon still runs."""
    data = _read(runtime_dir / STATUS_FILE)
    when = (data or {}).get("time")
    return float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None
