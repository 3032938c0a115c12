"""Sends spooled tasks to the store on one thread: parts first, the manifest last; backoff when it fails.

Every key is fixed by (node, incident, file), so sending again after a failure
or a restart overwrites the same objects: no duplicates. A reader lists
manifests only, so it never sees an incident whose parts are still on the way.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from . import layout
from .outbox import Outbox, Task
from .url import StoreURL

log = structlog.get_logger("hangwatchd.fleet")

BACKOFF_MIN = 0.5
BACKOFF_MAX = 30.0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def incident_files(root: Path) -> list[Path]:
    """Every regular file of an incident, incident.json last; no links, no temporaries."""
    files = []
    for dirpath, dirnames, names in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for n in names:
            p = Path(dirpath) / n
            if not n.startswith(".") and p.is_file() and not p.is_symlink():
                files.append(p)
    return sorted(files, key=lambda p: (p.name == "incident.json", str(p)))


def build_manifest(node: str, task: Task, root: Path, files: list[Path]) -> dict[str, Any]:
    try:
        meta = json.loads((root / "incident.json").read_text())
    except (OSError, ValueError):
        meta = {}
    procs = [p for p in meta.get("processes", []) if isinstance(p, dict)]
    return {
        "node": node, "incident": task.incident, "job": task.job, "job_incident": task.job_incident,
        "time": meta.get("time"), "reason": meta.get("reason"), "detail": meta.get("detail"),
        "summary": meta.get("verdict"), "complete": meta.get("complete", True),
        "ranks": sorted(p["rank"] for p in procs if isinstance(p.get("rank"), int)),
        "world_size": next((p["world_size"] for p in procs if p.get("world_size")), None),
        "processes": [{"pid": p.get("pid"), "rank": p.get("rank"), "dir": p.get("dir")} for p in procs],
        "parts": layout.part(node, task.incident, ""),
        "files": [{"path": str(f.relative_to(root)), "size": f.stat().st_size, "sha256": _sha256(f)} for f in files],
        "uploaded": time.time(),
        **({"declared_as": task.detail["declared_as"]} if task.detail.get("declared_as") else {}),
    }


class Uploader:
    def __init__(self, url: StoreURL, node: str, spool: Outbox, client: Callable[[], Any],
                 resolve: Callable[[Task], Task], on_request: Callable[[Task], Task],
                 counted: Callable[[str, int], None] = lambda outcome, spooled: None, kind: str = "incident") -> None:
        self.url = url
        self.node = node
        self.spool = spool
        self._client = client
        self._resolve = resolve  # the job incident a task really belongs to (another node may have asked first)
        self._on_request = on_request  # posts a request; returns it as posted (or as adopted)
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._counted = counted  # (outcome "ok"/"failed", tasks still spooled): for the metrics
        self.kind = kind  # the kind of task this sender takes: requests never wait behind a large upload
        self.then: Callable[[], None] = lambda: None  # after each task sent (the request sender wakes the uploader)
        self.backoff = 0.0
        self.failures = 0
        self.sent = 0
        self.thread = threading.Thread(target=self._run, name=f"store-{kind}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, wait: float = 5.0) -> None:
        self._stop.set()
        self._kick.set()
        self.thread.join(wait)

    def kick(self) -> None:
        self._kick.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(self.backoff or None)
            self._kick.clear()
            if self._stop.is_set():
                return
            self.drain()

    def drain(self) -> bool:
        """Send what is spooled, oldest first; stop at the first failure (the store is likely down)."""
        tasks = self.spool.tasks()
        # An incident waits for its job's request: that is where its job incident id is settled.
        asking = {t.job for t in tasks if t.kind == "request"}
        for task in tasks:
            if task.kind != self.kind or (task.kind == "incident" and task.job in asking):
                continue
            if self._stop.is_set():
                return False
            try:
                self._send(task)
            except Exception as exc:  # noqa: BLE001 - any failure: keep it spooled and back off
                self.failures += 1
                self.backoff = min(BACKOFF_MAX, max(BACKOFF_MIN, self.backoff * 2))
                log.warning("store_upload_failed", task=task.name, error=f"{type(exc).__name__}: {exc}",
                            retry_in=round(self.backoff, 1))
                self._counted("failed", len(self.spool.names()))
                return False
            self.spool.done(task)
            self.sent += 1
            self._counted("ok", len(self.spool.names()))
            self.then()
        self.backoff = 0.0
        return True

    def _send(self, task: Task) -> None:
        if task.kind == "request":
            self._on_request(task)
            return
        task = self._resolve(task)
        root = Path(task.dir)
        if not (root / "incident.json").is_file():
            log.warning("store_upload_gone", incident=task.incident, dir=task.dir)  # retention removed it
            return
        s3 = self._client()
        files = incident_files(root)
        for f in files:
            key = self.url.key(layout.part(self.node, task.incident, str(f.relative_to(root))))
            s3.upload_file(str(f), self.url.bucket, key)
        manifest = build_manifest(self.node, task, root, files)
        s3.put_object(Bucket=self.url.bucket, Key=self.url.key(layout.manifest(task.job, task.job_incident, self.node, task.incident)),
                      Body=json.dumps(manifest, indent=1).encode(), ContentType="application/json")
        log.info("store_uploaded", incident=task.incident, job=task.job, job_incident=task.job_incident,
                 files=len(files), bytes=sum(f["size"] for f in manifest["files"]))
