"""What the daemon says about itself: daemon.json and status.json in the runtime dir, and systemd's STATUS=.

``hangwatchd status`` and the clients read these files (``runtime``); the
daemon writes them here, on every state change and every few seconds, so a
reader always sees a whole file of a recent moment. The loop only hands over
a snapshot (``post``): plain data made on the loop (``Watched.status_row``),
never a live record; a thread of its own writes it, at most once a second
(reading each process's STATUS= file and writing the JSON take time that
grows with the number watched, and a disk can stall): the latest snapshot
wins, older ones are dropped unwritten. The same thread writes the other
files the loop hands it (``post_file``: health.json), the latest of each.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from .. import __version__
from ..host import procfs
from ..host.notify import notify
from ..model import Registration
from ..watch.watched import notify_status
from ..workload.runtime_files import DAEMON_FILE, STATUS_FILE, write_json

log = structlog.get_logger("hangwatchd.daemon")

STATUS_EVERY = 10.0  # seconds: status.json is rewritten at least this often (`status` reads beat ages from the segments)
WRITE_GAP = 1.0  # seconds: status.json is written at most this often, however many states change

Row = tuple[dict[str, Any], Registration]  # a process's status (plain data) and its frozen registration (for its STATUS=)


class StatusFile:
    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self.metrics_address = ""
        self._cond = threading.Condition()
        self._latest: list[Row] | None = None  # the one snapshot waiting to be written (a newer replaces it)
        self._files: dict[Path, dict[str, Any]] = {}  # other files waiting, the latest of each
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.written = 0  # snapshots written (the bench and tests read it)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="status", daemon=True)
        self._thread.start()

    def post(self, rows: list[Row]) -> None:
        """On the loop: a snapshot to write soon (plain data: no record the loop goes on changing). Never blocks on the disk."""
        with self._cond:
            self._latest = rows
            self._cond.notify()

    def post_file(self, path: Path, data: dict[str, Any]) -> None:
        """On the loop: another JSON file of the runtime dir to write soon, whole (the latest wins)."""
        with self._cond:
            self._files[path] = data
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        last = 0.0
        while True:
            with self._cond:
                while self._latest is None and not self._files and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                files, self._files = self._files, {}
            for path, data in files.items():
                self._write_json(path, data)
            if self._latest is None:
                continue
            time.sleep(max(0.0, last + WRITE_GAP - time.monotonic()))  # debounce: changes meanwhile join this write
            with self._cond:
                snapshot, self._latest = self._latest, None
            if snapshot is None:
                continue
            last = time.monotonic()
            try:
                self.write(snapshot)
            except Exception as exc:  # a bad record costs this write, never the writer
                log.exception("status_write_failed", file=str(self.runtime_dir / STATUS_FILE), error=f"{type(exc).__name__}: {exc}")
            self.written += 1

    def write_daemon(self, state_dir: str, dump_dir: Path, metrics_address: str, exception_fifo: str | None = None) -> None:
        """daemon.json: who the daemon is and where it keeps things (what clients look for).
        ``exception_fifo``: the CUDA_COREDUMP_FILE its launchers set, ``{uid}`` for the user's (where
        the daemon makes exception FIFOs)."""
        self.metrics_address = metrics_address
        me = procfs.identify(os.getpid())
        info = {
            "pid": os.getpid(), "start_time": me.start_time if me else None, "version": __version__,
            "state_dir": state_dir, "dump_dir": str(dump_dir), "metrics_address": metrics_address,
        }
        if exception_fifo:
            info["exception_fifo"] = exception_fifo
        self._write_json(self.runtime_dir / DAEMON_FILE, info)

    def write(self, rows: Iterable[Row]) -> None:
        """status.json (every watched process) and the matching STATUS= line."""
        processes = [{**row, "notify_status": notify_status(reg)} for row, reg in rows]
        counts: dict[str, int] = {}
        for p in processes:
            counts[p["state"]] = counts.get(p["state"], 0) + 1
        self._write_json(self.runtime_dir / STATUS_FILE, {
            "pid": os.getpid(), "time": time.time(), "metrics_address": self.metrics_address,
            "processes": processes,
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
