"""What the daemon says about itself: daemon.json and status.json in the runtime dir, and systemd's STATUS=.

``hangwatchd status`` and the clients read these files (``runtime``); the
daemon writes them here, on every state change and every few seconds, so a
reader always sees a whole file of a recent moment.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from .. import __version__
from ..host import procfs
from ..host.notify import notify
from ..watch.watched import Watched
from ..workload.runtime_files import DAEMON_FILE, STATUS_FILE, write_json

log = structlog.get_logger("hangwatchd.daemon")

STATUS_EVERY = 2.0  # seconds: status.json is rewritten at least this often (beat ages move on)


class StatusFile:
    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self.metrics_address = ""

    def write_daemon(self, state_dir: str, dump_dir: Path, metrics_address: str) -> None:
        """daemon.json: who the daemon is and where it keeps things (what clients look for)."""
        self.metrics_address = metrics_address
        me = procfs.identify(os.getpid())
        self._write_json(self.runtime_dir / DAEMON_FILE, {
            "pid": os.getpid(), "start_time": me.start_time if me else None, "version": __version__,
            "state_dir": state_dir, "dump_dir": str(dump_dir), "metrics_address": metrics_address,
        })

    def write(self, watched: Iterable[Watched]) -> None:
        """status.json (every watched process) and the matching STATUS= line."""
        watched = list(watched)
        counts: dict[str, int] = {}
        for w in watched:
            counts[w.state.value] = counts.get(w.state.value, 0) + 1
        self._write_json(self.runtime_dir / STATUS_FILE, {
            "pid": os.getpid(), "time": time.time(), "metrics_address": self.metrics_address,
            "processes": [w.summary() for w in watched],
        })
        self.say(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "watching no processes")

    @staticmethod
    def say(text: str) -> None:
        """systemd's one-line STATUS=, as 'systemctl status' shows it."""
        notify(f"STATUS={text}")

    def remove(self) -> None:
        for name in (DAEMON_FILE, STATUS_FILE):
            (self.runtime_dir / name).unlink(missing_ok=True)

    @staticmethod
    def _write_json(path: Path, data: dict[str, Any]) -> None:
        try:
            write_json(path, data)
        except OSError as exc:
            log.error("status_write_failed", file=str(path), error=str(exc))
