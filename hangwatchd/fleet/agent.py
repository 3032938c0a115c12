"""The node's side of the shared store: job incident ids, capture requests in and out, uploads.

No node listens on a port. A node that declares a job hung writes a request
object; every node polls, for each job it watches, one small object
(``requests/JOB/latest-uUID.json``) with a conditional GET (``If-None-Match``), so an
idle poll costs one request and no body. One job hang is one job incident:
a node that finds a fresh request for the job adopts its id instead of asking
again, and a node already capturing that job does not capture it twice.

A job is (owner, name) here too: two users' jobs of one name have their own
requests, ids and polls, so one user's request can neither stand in for nor
hide another's. ``requests/JOB/latest.json`` is still written, for daemons
older than that, and never read.

Each new request the poller reads goes to the daemon loop's queue as the
``CaptureRequest`` value it is; the loop decides what to capture.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ..model import JobPace
from . import layout, paces, s3
from .outbox import Outbox, Task
from .reader import read_capped
from .uploader import Uploader
from .url import StoreURL, parse

log = structlog.get_logger("hangwatchd.fleet")


MAX_REQUEST = 64 << 10  # bytes of a capture request (a real one is a few hundred); the rest is never read
MAX_DETAIL = 2000  # characters of a request's detail kept (it lands in incidents and logs)


@dataclass(frozen=True)
class CaptureRequest:
    """Another node (or this one) declared ``job`` hung: capture its ranks here under ``job_incident``."""

    job: str
    job_incident: str
    node: str
    time: float
    reason: str
    detail: str
    on_hang: str = "report"  # what the job's owner asked for where it was declared: every node acts after its own capture
    uid: int | None = None  # the job's owner where it was declared: a job is (owner, name), here too (None: an older daemon)


JobKey = tuple[int | None, str]  # (owner's uid, job name): None for an older daemon's request, which has no uid


def new_job_incident(now: float) -> str:
    return "job-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(4)


class Agent:
    def __init__(self, url: str, node: str, state_dir: Path, poll_interval: float, window: float,
                 spool_max: int, post: Callable[[object], None] = lambda _m: None,
                 counted: Callable[[str, int], None] = lambda outcome, spooled: None, pace_interval: float = 30.0) -> None:
        self.url: StoreURL = parse(url)
        self.node = node
        self.poll_interval = poll_interval
        self.window = window  # requests older than this are a past hang, not this one
        self.post = post  # the loop's queue: each new capture request goes there
        self.spool = Outbox(state_dir / "store-spool", spool_max)
        self._s3: Any = None
        self._lock = threading.Lock()
        self.jobs: frozenset[JobKey] = frozenset()  # the (uid, job)s this node watches, set by the daemon
        self.current: dict[JobKey, tuple[str, float]] = {}  # (uid, job) -> (job incident, monotonic time) in hand here
        self.alias: dict[str, str] = {}  # our job incident id -> the one another node asked first
        self.etags: dict[str, str] = {}  # the key polled -> its last ETag
        self.polls = 0
        # A job's pace: this node's records, handed over by the loop (replaced whole), written every
        # pace_interval; and the jobs slower here, whose other nodes' records are read back as often.
        self.paces: dict[tuple[int, str], JobPace] = {}
        self.pace_reads: frozenset[tuple[int, str]] = frozenset()
        self.pace_interval = pace_interval
        self.paces_at = 0.0
        self._stop = threading.Event()
        self.uploader = Uploader(self.url, node, self.spool, self.client, self._resolve, self._post, counted)
        self.requester = Uploader(self.url, node, self.spool, self.client, self._resolve, self._post, counted, kind="request")
        self.requester.then = self.uploader.kick
        self.poller = threading.Thread(target=self._poll_loop, name="store-poll", daemon=True)

    def client(self) -> Any:
        with self._lock:
            if self._s3 is None:
                self._s3 = s3.client()
            return self._s3

    def start(self) -> None:
        self.spool.open()
        self.uploader.start()
        self.requester.start()
        self.poller.start()
        self.uploader.kick()  # what a previous run left spooled
        self.requester.kick()

    def stop(self) -> None:
        self._stop.set()
        self.uploader.stop()
        self.requester.stop()
        self.poller.join(5)

    # -- on the daemon's thread: never touches the network ----------------

    def declare(self, job: str, reason: str, detail: str, on_hang: str = "report", uid: int | None = None) -> str:
        """This node declares ``job`` hung: the job incident id to tag the capture with, and a request queued."""
        now = time.monotonic()
        with self._lock:
            held = self.current.get((uid, job))
            if held and now - held[1] < self.window:
                return held[0]
            job_incident = new_job_incident(time.time())
            self.current[(uid, job)] = (job_incident, now)
        self.spool.put(Task("request", job, job_incident, detail={
            "job": job, "job_incident": job_incident, "node": self.node, "time": time.time(),
            "reason": reason, "detail": detail, "on_hang": on_hang, "uid": uid}))
        self.requester.kick()
        return job_incident

    def accept(self, request: CaptureRequest) -> bool:
        """Whether this node should capture for ``request`` (False: it already has this hang in hand)."""
        now = time.monotonic()
        with self._lock:
            held = self.current.get((request.uid, request.job))
            if held and now - held[1] < self.window:
                if held[0] != request.job_incident:
                    self.alias[held[0]] = request.job_incident
                return False
            self.current[(request.uid, request.job)] = (request.job_incident, now)
            return True

    def stored(self, incident: str, directory: Path, job: str | None, job_incident: str | None) -> None:
        """A local incident is complete: queue it for the store."""
        self.spool.put(self._resolve(Task("incident", job, job_incident or incident, incident=incident, dir=str(directory))))
        self.uploader.kick()

    # -- on the uploader's thread ------------------------------------------

    def _resolve(self, task: Task) -> Task:
        canonical = self.alias.get(task.job_incident)
        if canonical and task.kind == "incident":  # the manifest keeps the id this node first gave it, as declared_as
            return Task(**{**task.__dict__, "job_incident": canonical, "detail": {"declared_as": task.job_incident}})
        return task

    def _post(self, task: Task) -> Task:
        """Write the request, unless another node's fresh request for the job is there: then adopt it."""
        assert task.job
        uid = task.detail.get("uid") if isinstance(task.detail, dict) else None
        uid = uid if type(uid) is int else None
        theirs = self._get_latest(task.job, uid, conditional=False)
        if theirs and theirs.job_incident != task.job_incident and time.time() - theirs.time < self.window:
            self.alias[task.job_incident] = theirs.job_incident
            with self._lock:
                self.current[(uid, task.job)] = (theirs.job_incident, time.monotonic())
            for spooled in self.spool.tasks():  # already spooled under our id: rewritten, so a restart keeps theirs
                if spooled.kind == "incident" and spooled.job_incident == task.job_incident:
                    self.spool.put(self._resolve(spooled))
            log.info("store_request_adopted", job=task.job, ours=task.job_incident, theirs=theirs.job_incident, node=theirs.node)
            return task
        body = json.dumps(task.detail).encode()
        c = self.client()
        c.put_object(Bucket=self.url.bucket, Key=self.url.key(layout.request(task.job, task.job_incident)), Body=body)
        c.put_object(Bucket=self.url.bucket, Key=self.url.key(layout.latest_request(task.job, uid)), Body=body)
        if uid is not None:  # where daemons older than per-owner requests look
            c.put_object(Bucket=self.url.bucket, Key=self.url.key(layout.latest_request(task.job)), Body=body)
        log.info("store_request_posted", job=task.job, job_incident=task.job_incident)
        return task

    # -- on the poller's thread --------------------------------------------

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_interval):
            if time.monotonic() >= self.paces_at:
                self.paces_at = time.monotonic() + self.pace_interval
                self._paces()
            jobs = self.jobs
            self._forget_past(jobs)
            for uid, job in sorted(jobs, key=lambda k: (k[1], -1 if k[0] is None else k[0])):
                try:
                    req = self._get_latest(job, uid, conditional=True)
                except Exception as exc:  # noqa: BLE001 - the store is down: try again next round
                    log.debug("store_poll_failed", job=job, uid=uid, error=f"{type(exc).__name__}: {exc}")
                    continue
                # A request is read once (its ETag): the loop's queue holds at most one per write to the
                # store, and waits for the loop when full rather than drop one.
                if req and req.node != self.node and time.time() - req.time < self.window:
                    self.post(req)

    def _paces(self) -> None:
        """This node's records of its jobs' pace out; the other nodes' records of the jobs slower here in."""
        for record in list(self.paces.values()):
            try:
                paces.publish(self.client(), self.url, record)
            except Exception as exc:  # noqa: BLE001 - the store is down: the next round writes a newer record
                log.debug("store_pace_failed", job=record.job, error=f"{type(exc).__name__}: {exc}")
        for uid, job in sorted(self.pace_reads):
            try:
                records = paces.read(self.client(), self.url, job, uid)
            except Exception as exc:  # noqa: BLE001 - as above: read again next round
                log.debug("store_pace_failed", job=job, error=f"{type(exc).__name__}: {exc}")
                continue
            self.post(paces.PacesRead((uid, job), tuple(r for r in records if r.node != self.node)))

    def _forget_past(self, jobs: frozenset[JobKey]) -> None:
        """Only jobs watched here keep an ETag, and only hangs within the window stay in hand: the
        tables are bounded by what the node watches now, not by every job it ever saw."""
        keys = {self.url.key(layout.latest_request(job, uid)) for uid, job in jobs}
        self.etags = {k: v for k, v in self.etags.items() if k in keys}
        now = time.monotonic()
        with self._lock:
            self.current = {k: v for k, v in self.current.items() if now - v[1] < self.window}

    def _get_latest(self, job: str, uid: int | None, conditional: bool) -> CaptureRequest | None:
        """The newest request of (uid, job); None when there is none, it is unchanged or unreadable."""
        key = self.url.key(layout.latest_request(job, uid))
        args: dict[str, Any] = {"Bucket": self.url.bucket, "Key": key}
        if conditional and key in self.etags:
            args["IfNoneMatch"] = self.etags[key]
        self.polls += 1
        try:
            resp = self.client().get_object(**args)
        except Exception as exc:
            if s3.not_modified(exc) or s3.is_missing(exc):
                return None
            raise
        self.etags[key] = resp["ETag"]
        try:
            if int(resp.get("ContentLength") or 0) > MAX_REQUEST:
                resp["Body"].close()
                raise ValueError(f"larger than {MAX_REQUEST} bytes")
            d = json.loads(read_capped(resp["Body"], MAX_REQUEST, key))
            req = CaptureRequest(str(d["job"]), str(d["job_incident"]), str(d["node"]), float(d["time"]),
                                 str(d.get("reason", ""))[:200], str(d.get("detail", ""))[:MAX_DETAIL],
                                 "abort" if d.get("on_hang") == "abort" else "report",
                                 d["uid"] if type(d.get("uid")) is int and d["uid"] >= 0 else None)
            if req.job != job:
                raise ValueError(f"it names job {req.job[:80]!r}, not {job[:80]!r}")
            if uid is not None and req.uid != uid:
                raise ValueError(f"it names uid {req.uid}, not {uid}")
            layout.check_segment(layout.seg(req.job_incident), "job incident id")
            return req
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # layout.BadKey and TooBig are ValueErrors
            log.warning("store_request_unreadable", key=key, error=str(exc)[:200])
            return None
