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

from ..incidents import ledger
from . import layout
from .outbox import Outbox, Task
from .url import StoreURL

log = structlog.get_logger("hangwatchd.fleet")

BACKOFF_MIN = 0.5
BACKOFF_MAX = 30.0
TASK_ATTEMPTS = 5  # a task that failed this many times while others went through is dropped (the incident stays on the node)
FAILURES_IN_A_ROW = 2  # failures in a row in one pass: the store is likely down, back off
KEY_MAX = 1024  # bytes in an S3 object key


class Unsendable(Exception):
    """This task can never be sent (a key past the store's limit): dropped at once, the others go on."""


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


def _ledger_entry(root: Path) -> dict[str, Any] | None:
    """The incident's entry in the ledger of suspects, as the store wrote it beside the incident's record."""
    try:
        meta = json.loads((root / "incident.json").read_text())
    except (OSError, ValueError):
        return None
    return ledger.entry_of(meta) if isinstance(meta, dict) else None


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
        self.attempts: dict[str, int] = {}  # task name -> failed sends so far (only tasks still in the outbox)
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
        """Send what is spooled, oldest first. One task's failure does not hold up those behind it:
        it is tried again at the next pass, and dropped after TASK_ATTEMPTS while others get
        through (or at once when it can never be sent); failures in a row mean the store is
        down: stop and back off."""
        tasks = self.spool.tasks()
        names = {t.name for t in tasks}
        self.attempts = {k: v for k, v in self.attempts.items() if k in names}  # bounded by the outbox
        in_a_row = 0
        ok = True
        # An incident waits for its job's request: that is where its job incident id is settled.
        asking = {t.job for t in tasks if t.kind == "request"}
        for task in tasks:
            if task.kind != self.kind or (task.kind == "incident" and task.job in asking):
                continue
            if self._stop.is_set():
                return False
            try:
                self._send(task)
            except Exception as exc:  # any failure: keep it spooled (or drop it), go on or back off
                self.failures += 1
                in_a_row += 1
                ok = False
                tries = self.attempts[task.name] = self.attempts.get(task.name, 0) + 1
                self._counted("failed", len(self.spool.names()))
                if isinstance(exc, Unsendable) or tries >= TASK_ATTEMPTS:
                    log.error("store_upload_dropped", task=task.name, attempts=tries, error=f"{type(exc).__name__}: {exc}",
                              note="the incident stays on this node", exc_info=exc)
                    self.spool.done(task)
                    self.attempts.pop(task.name, None)
                    in_a_row -= 1  # this task's fault, not the store's
                    continue
                self.backoff = min(BACKOFF_MAX, max(BACKOFF_MIN, self.backoff * 2))
                log.warning("store_upload_failed", task=task.name, error=f"{type(exc).__name__}: {exc}", attempt=tries,
                            retry_in=round(self.backoff, 1), exc_info=exc)
                if in_a_row >= FAILURES_IN_A_ROW:
                    return False
                continue
            in_a_row = 0
            self.attempts.pop(task.name, None)
            self.spool.done(task)
            self.sent += 1
            self._counted("ok", len(self.spool.names()))
            self.then()
        if ok:
            self.backoff = 0.0
        return ok

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
        manifest_key = self.url.key(layout.manifest(task.job, task.job_incident, self.node, task.incident))
        keys = [self.url.key(layout.part(self.node, task.incident, str(f.relative_to(root)))) for f in files]
        too_long = [k for k in [manifest_key, *keys] if len(k.encode()) > KEY_MAX]
        if too_long:
            raise Unsendable(f"key of {len(too_long[0].encode())} bytes, past the store's {KEY_MAX}: {too_long[0][:120]}...")
        for f, key in zip(files, keys):
            s3.upload_file(str(f), self.url.bucket, key)
        manifest = build_manifest(self.node, task, root, files)
        s3.put_object(Bucket=self.url.bucket, Key=manifest_key,
                      Body=json.dumps(manifest, indent=1).encode(), ContentType="application/json")
        entry = _ledger_entry(root)
        if entry is not None:  # after the manifest: a ledger entry always has its incident in the store
            s3.put_object(Bucket=self.url.bucket, Key=self.url.key(layout.ledger(self.node, task.incident)),
                          Body=json.dumps(entry, indent=1).encode(), ContentType="application/json")
        log.info("store_uploaded", incident=task.incident, job=task.job, job_incident=task.job_incident,
                 files=len(files), bytes=sum(f["size"] for f in manifest["files"]))
