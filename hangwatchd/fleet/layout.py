"""Where things live in the store, all under its prefix.

    nodes/NODE/incidents/ID/PATH          an incident's files (parts), uploaded first
    jobs/JOB/JOBINC/NODE/ID.json          its manifest, uploaded last: a reader lists these
    requests/JOB/latest-uUID.json         the newest capture request of the job of user UID (what nodes poll)
    requests/JOB/latest.json              the same for daemons older than that (they poll the job's name alone)
    requests/JOB/JOBINC.json              every request, kept as the record
    paces/JOB/uUID/NODE.json              a node's record of the pace of user UID's job JOB (overwritten)
    ledger/NODE/ID.json                   the incident's entry in the ledger of suspects (incidents/ledger.py),
                                          uploaded after its manifest, where its verdict blames a GPU

A job incident id (JOBINC) is shared by every node's part of one job hang.
Job names (``host:port``, run ids) are percent-encoded into one key segment.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

NO_JOB = "_none"

# What a key segment or a file name read back from the store may be before it touches a
# path here: the store is written by every node, and a node may be compromised or wrong.
MAX_SEGMENT = 255  # bytes of one segment (a file name's limit on every Linux filesystem)
MAX_PATH = 1024  # bytes of a relative path or a key
MAX_DEPTH = 8  # segments in a relative path (an incident's files are two deep)
_SEGMENT = re.compile(r"[A-Za-z0-9_@=+%-][A-Za-z0-9._@=+%-]*")  # seg()'s output, and the daemon's own file names


class BadKey(ValueError):
    """A key or file name from the store that must not touch a path: one line saying which and why."""


def check_segment(segment: str, what: str = "name") -> str:
    """``segment`` when it is one safe path segment: no '/', no '..', not empty, bounded, a closed set."""
    if not isinstance(segment, str) or not segment:
        raise BadKey(f"an empty {what} in the store")
    if len(segment.encode()) > MAX_SEGMENT:
        raise BadKey(f"a {what} longer than {MAX_SEGMENT} bytes in the store: {segment[:40]!r}…")
    if not _SEGMENT.fullmatch(segment):
        raise BadKey(f"the {what} {segment[:80]!r} in the store is not one plain name "
                     "(letters, digits and ._@=+%- only, not starting with a dot)")
    return segment


def check_relpath(rel: str, what: str = "file") -> tuple[str, ...]:
    """The segments of ``rel``, a relative path from the store, each checked: no absolute part,
    no '..' or '.', no empty segment ('a//b'), at most MAX_DEPTH deep and MAX_PATH long."""
    if not isinstance(rel, str) or not rel:
        raise BadKey(f"an empty {what} path in the store")
    if len(rel.encode()) > MAX_PATH:
        raise BadKey(f"a {what} path longer than {MAX_PATH} bytes in the store")
    parts = tuple(rel.split("/"))
    if len(parts) > MAX_DEPTH:
        raise BadKey(f"the {what} path {rel[:80]!r} in the store is deeper than {MAX_DEPTH}")
    for p in parts:
        check_segment(p, f"{what} path segment (of {rel[:80]!r})")
    return parts


def seg(name: str) -> str:
    return quote(name, safe="-_.@=+") or NO_JOB


def unseg(segment: str) -> str:
    return unquote(segment)


def part(node: str, incident: str, rel: str) -> str:
    return f"nodes/{seg(node)}/incidents/{seg(incident)}/{rel}"


def manifest(job: str | None, job_incident: str, node: str, incident: str) -> str:
    return f"jobs/{seg(job) if job else NO_JOB}/{seg(job_incident)}/{seg(node)}/{seg(incident)}.json"


def ledger(node: str, incident: str) -> str:
    return f"ledger/{seg(node)}/{seg(incident)}.json"


LEDGER_PREFIX = "ledger/"


def jobs_prefix(job: str | None = None) -> str:
    return f"jobs/{seg(job)}/" if job else "jobs/"


def latest_request(job: str, uid: int | None = None) -> str:
    """The job's newest request: a job is (owner, name), so each owner of a name has their own."""
    return f"requests/{seg(job)}/latest.json" if uid is None else f"requests/{seg(job)}/latest-u{int(uid)}.json"


def request(job: str, job_incident: str) -> str:
    return f"requests/{seg(job)}/{seg(job_incident)}.json"


def pace(job: str, uid: int | None, node: str) -> str:
    """A node's record of a job's pace (its ranks' step time and wait shares), overwritten at a low rate."""
    return f"{paces_prefix(job, uid)}{seg(node)}.json"


def paces_prefix(job: str, uid: int | None = None) -> str:
    return f"paces/{seg(job)}/" if uid is None else f"paces/{seg(job)}/u{int(uid)}/"
