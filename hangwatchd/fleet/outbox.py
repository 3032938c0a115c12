"""What is still to be sent to the store, on disk under the state dir, so a restart loses nothing.

One small JSON file a task, named so that a directory listing gives the order
they were queued in. A task only points at an incident directory (the state
dir keeps the files), so the spool stays small; it is bounded by count, the
oldest dropped first (the incident itself stays on the node).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ..host.atomic import write_atomic

log = structlog.get_logger("hangwatchd.fleet")


@dataclass(frozen=True)
class Task:
    kind: str  # "request": ask the job's other nodes to capture; "incident": upload one incident
    job: str | None
    job_incident: str
    incident: str = ""  # the local incident id, for "incident"
    dir: str = ""  # the local incident directory, for "incident"
    detail: dict[str, Any] = field(default_factory=dict)  # the request's body, for "request"
    queued: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.queued:017.6f}-{self.kind}-{self.incident or self.job_incident}.json"


class Outbox:
    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit

    def open(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        for stray in self.path.glob(".*.tmp"):
            stray.unlink(missing_ok=True)

    def put(self, task: Task) -> Task:
        if not task.queued:
            task = Task(**{**asdict(task), "queued": time.time()})
        write_atomic(self.path / task.name, json.dumps(asdict(task)).encode())
        for old in self.names()[: -self.limit]:
            log.warning("store_spool_full", dropped=old, limit=self.limit)
            (self.path / old).unlink(missing_ok=True)
        return task

    def names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.path) if n.endswith(".json") and not n.startswith("."))
        except FileNotFoundError:
            return []

    def tasks(self) -> list[Task]:
        out = []
        for name in self.names():
            try:
                out.append(Task(**json.loads((self.path / name).read_text())))
            except (OSError, ValueError, TypeError):
                log.warning("store_spool_unreadable", file=name)
                (self.path / name).unlink(missing_ok=True)
        return out

    def done(self, task: Task) -> None:
        (self.path / task.name).unlink(missing_ok=True)
