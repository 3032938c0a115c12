"""Reading the store back: job incidents across nodes, and one job put together as a local incident directory.

A job incident is the set of manifests under ``jobs/JOB/JOBINC/``; only
manifests are listed, so only fully uploaded node parts are ever seen.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..analyze.jsonfile import read_json_or_none
from . import layout, s3
from .url import StoreURL


class ReadError(Exception):
    """The store cannot be read: one line saying what and where."""


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


def _get_json(client: Any, url: StoreURL, key: str) -> dict[str, Any] | None:
    try:
        data = json.loads(client.get_object(Bucket=url.bucket, Key=key)["Body"].read())
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


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
            m = _get_json(c, url, key)
            if not m or "node" not in m:
                continue
            nodes = by_inc.setdefault((layout.unseg(rest[0]), layout.unseg(rest[1])), {})
            old = nodes.get(m["node"])
            if old is None or (m.get("time") or 0) > (old.get("time") or 0):
                nodes[m["node"]] = m
    except Exception as exc:  # noqa: BLE001 - botocore's errors share no useful base; say what failed
        if isinstance(exc, ReadError):
            raise
        raise ReadError(f"store {url}: {type(exc).__name__}: {exc}") from None
    out = [JobIncident(j, ji, min((m.get("time") or 0) for m in ms.values()),
                       tuple(sorted(ms.values(), key=lambda m: m["node"])))
           for (j, ji), ms in by_inc.items()]
    return sorted(out, key=lambda x: (x.time, x.job_incident), reverse=True)


def fetch(url: StoreURL, inc: JobIncident, into: Path, client: Any = None) -> Path:
    """Download every node's part of ``inc`` into one incident directory: NODE-PID per process."""
    c = client or s3.client()
    processes: list[dict[str, Any]] = []
    into.mkdir(parents=True, exist_ok=True)
    try:
        for m in inc.manifests:
            node = str(m["node"])
            meta = _get_json(c, url, url.key(m["parts"] + "incident.json")) or {}
            known = {str(p.get("dir")): p for p in meta.get("processes", []) if isinstance(p, dict)}
            for f in m.get("files", []):
                rel = str(f["path"])
                top, _, sub = rel.partition("/")
                if not sub or rel.startswith("/") or ".." in rel.split("/"):
                    continue  # incident.json itself, or a path that would leave the directory
                dest = into / f"{layout.seg(node)}-{top}" / sub
                dest.parent.mkdir(parents=True, exist_ok=True)
                c.download_file(url.bucket, url.key(m["parts"] + rel), str(dest))
            for top, p in known.items():
                pdir = into / f"{layout.seg(node)}-{top}"
                if not pdir.is_dir():
                    continue
                processes.append({**p, "dir": pdir.name, "node": node})
                _stamp_node(pdir / "proc.json", node)
    except Exception as exc:  # noqa: BLE001
        raise ReadError(f"store {url}: {type(exc).__name__}: {exc}") from None
    merged = {"id": inc.job_incident, "job": inc.job, "job_incident": inc.job_incident, "time": inc.time,
              "nodes": [m["node"] for m in inc.manifests], "processes": processes}
    (into / "incident.json").write_text(json.dumps(merged, indent=1))
    return into


def _stamp_node(path: Path, node: str) -> None:
    """A node's proc.json names its node already; one put together by hand may not."""
    data = read_json_or_none(path)
    if isinstance(data, dict) and not data.get("node"):
        data["node"] = node
        tmp = path.with_name(".proc.json.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
