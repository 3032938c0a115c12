"""A job's pace across nodes: each node's record in the store, written at a low rate, read back checked.

Each node overwrites ``paces/JOB/uUID/NODE.json`` with its record of the job
(``model.JobPace``: its ranks' step time, wait shares and counters, its GPUs)
every ``slow_publish_interval``; a node whose job is slower reads the others'
to name the slowest rank of the whole job, and ``hangwatchd analyze --store
URL --job JOB`` reads them all. Every record read back is untrusted: its key
is checked, its body capped, every field checked (``model.pace_from_dict``),
and a record that names another job, user or node than its key is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import structlog

from ..model import JobPace, pace_from_dict, pace_to_dict
from . import layout, s3
from .reader import read_capped
from .url import StoreURL

log = structlog.get_logger("hangwatchd.fleet")

MAX_PACE = 1 << 20  # bytes of one node's record (a few hundred bytes a rank)
MAX_NODES = 1024  # records read for one job
FRESH = 3600.0  # seconds: records older than the newest by more are of another run of the job


@dataclass(frozen=True)
class PacesRead:
    """The other nodes' newest records of job ``key`` (uid, name), read from the store for the loop."""

    key: tuple[int, str]
    records: tuple[JobPace, ...]


def publish(client: Any, url: StoreURL, record: JobPace) -> None:
    body = json.dumps(pace_to_dict(record)).encode()
    client.put_object(Bucket=url.bucket, Key=url.key(layout.pace(record.job, record.uid, record.node)), Body=body)


def read(client: Any, url: StoreURL, job: str, uid: int | None = None) -> list[JobPace]:
    """Every node's record of ``job`` (of user ``uid``; None: of any user), each checked; a record
    that cannot be read is left out with one warning."""
    prefix = url.key(layout.paces_prefix(job, uid))
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=url.bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    out = []
    for key in sorted(keys)[:MAX_NODES]:
        try:
            out.append(_one(client, url, key, job, uid))
        except (ValueError, KeyError, TypeError) as exc:  # layout.BadKey and TooBig are ValueErrors
            log.warning("store_pace_refused", key=key[:200], error=str(exc)[:200])
    return out


def _one(client: Any, url: StoreURL, key: str, job: str, uid: int | None) -> JobPace:
    rest = key[len(url.key(layout.paces_prefix(job))):].split("/")
    if len(rest) != 2 or not rest[0].startswith("u") or not rest[0][1:].isdigit() or not rest[1].endswith(".json"):
        raise ValueError("not a pace record's key")
    node_seg = layout.check_segment(rest[1].removesuffix(".json"), "node")
    resp = client.get_object(Bucket=url.bucket, Key=key)
    if int(resp.get("ContentLength") or 0) > MAX_PACE:
        resp["Body"].close()
        raise ValueError(f"larger than {MAX_PACE} bytes")
    record = pace_from_dict(json.loads(read_capped(resp["Body"], MAX_PACE, key)))
    if record.job != job or record.uid != int(rest[0][1:]) or (uid is not None and record.uid != uid) \
            or layout.seg(record.node) != node_seg or any(r.node != record.node for r in record.ranks):
        raise ValueError("its job, user or node is not the one its key names")
    return record


def client() -> Any:
    return s3.client()
