"""Reading the store back: job incidents across nodes, and one job put together as a local incident directory.

A job incident is the set of manifests under ``jobs/JOB/JOBINC/``; only
manifests are listed, so only fully uploaded node parts are ever seen.

Every node writes the store, so what is read back is untrusted: each key and
file name is checked (``layout.check_segment``/``check_relpath``) before it
touches a path here, a part that names a bad one is skipped whole and said so,
and every body is read with a cap (a manifest or incident.json: MAX_JSON; a
file: MAX_FILE), never whole on the store's word.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ..analyze.jsonfile import read_json_or_none
from ..host.atomic import write_atomic
from ..incidents import ledger
from . import layout, s3
from .url import StoreURL

MAX_JSON = 16 << 20  # bytes of a manifest or an incident.json (real ones are a few KB)
MAX_FILE = 2 << 30  # bytes of one captured file (a compressed GPU dump is at most a few hundred MB)
CHUNK = 1 << 20


log = structlog.get_logger("hangwatchd.fleet")


class ReadError(Exception):
    """The store cannot be read: one line saying what and where."""


class TooBig(ValueError):
    """A body from the store larger than its cap."""


def read_capped(body: Any, cap: int, what: str) -> bytes:
    """At most ``cap`` bytes of a streaming body; TooBig past it (the rest is never read)."""
    data = body.read(cap + 1)
    if len(data) > cap:
        body.close()
        raise TooBig(f"{what} is larger than {cap >> 20} MB")
    return data


@dataclass(frozen=True)
class JobIncident:
    job: str
    job_incident: str
    time: float
    manifests: tuple[dict[str, Any], ...]  # each node's newest manifest, by node name

    def to_dict(self) -> dict[str, Any]:
        ranks = sorted({r for m in self.manifests for r in m.get("ranks", [])})
        world = max((m.get("world_size") or 0 for m in self.manifests), default=0)
        return {
            "job": self.job, "job_incident": self.job_incident, "time": self.time,
            "nodes": [m["node"] for m in self.manifests], "ranks": ranks,
            "ranks_not_captured": [r for r in range(world) if r not in ranks],
            "reason": next((m.get("reason") for m in self.manifests if m.get("reason") != "job-request"),
                           self.manifests[0].get("reason") if self.manifests else None),
            "parts": [{"node": m["node"], "incident": m["incident"], "ranks": m.get("ranks", []),
                       "summary": m.get("summary")} for m in self.manifests],
        }


def _list(client: Any, url: StoreURL, prefix: str) -> list[str]:
    keys: list[str] = []
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=url.bucket, Prefix=url.key(prefix))
    for page in pages:
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def _get_json(client: Any, url: StoreURL, key: str, cap: int = MAX_JSON) -> dict[str, Any] | None:
    """A JSON object from the store, read to at most ``cap`` bytes; None when it is not one (or too big)."""
    resp = client.get_object(Bucket=url.bucket, Key=key)
    try:
        if int(resp.get("ContentLength") or 0) > cap:
            resp["Body"].close()
            raise TooBig(f"{key} is larger than {cap} bytes")
        data = json.loads(read_capped(resp["Body"], cap, key))
    except ValueError as exc:  # TooBig is one
        log.warning("store_object_refused", key=key, error=str(exc))
        return None
    return data if isinstance(data, dict) else None


def _download(client: Any, url: StoreURL, key: str, dest_dir: int, name: str) -> None:
    """One file into ``dest_dir`` (an open directory we made) as ``name`` (checked), at most MAX_FILE bytes."""
    resp = client.get_object(Bucket=url.bucket, Key=key)
    body = resp["Body"]
    if int(resp.get("ContentLength") or 0) > MAX_FILE:
        body.close()
        raise TooBig(f"{key} is larger than {MAX_FILE >> 20} MB")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dest_dir)
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := body.read(CHUNK):
                size += len(chunk)
                if size > MAX_FILE:
                    body.close()
                    raise TooBig(f"{key} is larger than {MAX_FILE >> 20} MB")
                out.write(chunk)
    except TooBig:
        os.unlink(name, dir_fd=dest_dir)
        raise


def _subdir(parent: int, name: str) -> int:
    """An open descriptor of ``parent``/``name`` (checked), made if missing; never a link."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        pass
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)


def job_incidents(url: StoreURL, job: str | None = None, client: Any = None) -> list[JobIncident]:
    """Every job incident in the store (of ``job``), newest first; per node its newest part."""
    c = client or s3.client()
    try:
        keys = [k for k in _list(c, url, layout.jobs_prefix(job)) if k.endswith(".json")]
        by_inc: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        for key in keys:
            rest = key[len(url.key("jobs")) + 1:].split("/")
            if len(rest) != 4 or rest[0] == layout.NO_JOB:
                continue
            try:
                for segment in rest:
                    layout.check_segment(segment, "key segment")
            except layout.BadKey as exc:
                log.warning("store_key_refused", key=key, error=str(exc))
                continue
            m = _get_json(c, url, key)
            if not m or "node" not in m:
                continue
            nodes = by_inc.setdefault((layout.unseg(rest[0]), layout.unseg(rest[1])), {})
            old = nodes.get(m["node"])
            if old is None or (m.get("time") or 0) > (old.get("time") or 0):
                nodes[m["node"]] = m
    except Exception as exc:  # botocore's errors share no useful base; say what failed
        if isinstance(exc, ReadError):
            raise
        raise ReadError(f"store {url}: {type(exc).__name__}: {exc}") from None
    out = [JobIncident(j, ji, min((m.get("time") or 0) for m in ms.values()),
                       tuple(sorted(ms.values(), key=lambda m: m["node"])))
           for (j, ji), ms in by_inc.items()]
    return sorted(out, key=lambda x: (x.time, x.job_incident), reverse=True)


MAX_LEDGER_READ = 10_000  # ledger entries read from the store, the newest (one GET each)


def ledger_entries(url: StoreURL, client: Any = None, limit: int = MAX_LEDGER_READ) -> list[dict[str, Any]]:
    """Every node's entries in the ledger of suspects (the newest ``limit``), oldest first. Each is
    checked (``ledger.parse``) and must name the node it is filed under; others are left out, said once."""
    c = client or s3.client()
    try:
        found: list[tuple[str, str, str]] = []  # (incident, node, key)
        for key in _list(c, url, layout.LEDGER_PREFIX):
            rest = key[len(url.key(layout.LEDGER_PREFIX.rstrip("/"))) + 1:].split("/")
            try:
                if len(rest) != 2 or not rest[1].endswith(".json"):
                    raise layout.BadKey(f"not ledger/NODE/ID.json: {key[:120]!r}")
                for segment in rest:
                    layout.check_segment(segment, "ledger key segment")
            except layout.BadKey as exc:
                log.warning("store_key_refused", key=key[:200], error=str(exc))
                continue
            found.append((rest[1], layout.unseg(rest[0]), key))
        found.sort(reverse=True)  # an incident id begins with its time: the newest first
        out = []
        for _incident, node, key in found[:limit]:
            entry = ledger.parse(_get_json(c, url, key, ledger.MAX_ENTRY))
            if entry is None or entry.get("node") != node:
                log.warning("store_ledger_entry_refused", key=key[:200], error="not a ledger entry of the node it is filed under")
                continue
            out.append(entry)
    except Exception as exc:  # noqa: BLE001 - whatever the store or its client raised is one ReadError line for the CLI
        raise ReadError(f"store {url}: {type(exc).__name__}: {exc}") from None
    return sorted(out, key=lambda e: e["time"])


def fetch(url: StoreURL, inc: JobIncident, into: Path, client: Any = None) -> Path:
    """Download every node's part of ``inc`` into one incident directory: NODE-PID per process.

    A part that names a bad key or file (``..``, an absolute or empty segment, odd characters,
    too long) or a body past its cap is left out whole, with one warning; nothing is written
    outside ``into``, and every file is made new under a directory made here (never a link)."""
    c = client or s3.client()
    processes: list[dict[str, Any]] = []
    into.mkdir(parents=True, exist_ok=True)
    root = os.open(into, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for m in inc.manifests:
            try:
                processes += _fetch_part(c, url, m, into, root)
            except (layout.BadKey, TooBig) as exc:
                log.warning("store_part_refused", node=str(m.get("node"))[:80], error=str(exc))
    except Exception as exc:  # noqa: BLE001 - whatever the store or its client raised is one ReadError line for the CLI
        raise ReadError(f"store {url}: {type(exc).__name__}: {exc}") from None
    finally:
        os.close(root)
    merged = {"id": inc.job_incident, "job": inc.job, "job_incident": inc.job_incident, "time": inc.time,
              "nodes": [m["node"] for m in inc.manifests], "processes": processes}
    (into / "incident.json").write_text(json.dumps(merged, indent=1))
    return into


def _fetch_part(c: Any, url: StoreURL, m: dict[str, Any], into: Path, root: int) -> list[dict[str, Any]]:
    """One node's part: checked first (every name), then downloaded."""
    node = str(m["node"])
    parts = str(m.get("parts") or "")
    layout.check_relpath(parts.rstrip("/"), "parts prefix")
    raw_files = m.get("files")
    files = raw_files if isinstance(raw_files, list) else []
    wanted: list[tuple[str, tuple[str, ...]]] = []
    for f in files:
        rel = str(f.get("path") if isinstance(f, dict) else f)
        segs = layout.check_relpath(rel)
        if len(segs) < 2:
            continue  # incident.json itself: the merged one is written below
        wanted.append((rel, segs))
    meta = _get_json(c, url, url.key(parts + "incident.json")) or {}
    known = {str(p.get("dir")): p for p in meta.get("processes", []) if isinstance(p, dict)}
    for rel, segs in wanted:
        top = layout.check_segment(f"{layout.seg(node)}-{segs[0]}", "process directory")
        fd = _subdir(root, top)
        try:
            for d in segs[1:-1]:
                nxt = _subdir(fd, d)
                os.close(fd)
                fd = nxt
            _download(c, url, url.key(parts + rel), fd, segs[-1])
        finally:
            os.close(fd)
    processes = []
    for top, p in known.items():
        try:
            pdir_name = layout.check_segment(f"{layout.seg(node)}-{top}", "process directory")
        except layout.BadKey:
            continue
        pdir = into / pdir_name
        if not pdir.is_dir() or pdir.is_symlink():
            continue
        processes.append({**p, "dir": pdir.name, "node": node})
        _stamp_node(pdir / "proc.json", node)
    return processes


def _stamp_node(path: Path, node: str) -> None:
    """A node's proc.json names its node already; one put together by hand may not."""
    data = read_json_or_none(path)
    if isinstance(data, dict) and not data.get("node"):
        data["node"] = node
        write_atomic(path, json.dumps(data).encode())
