"""Where things live in the store, all under its prefix.

    nodes/NODE/incidents/ID/PATH          an incident's files (parts), uploaded first
    jobs/JOB/JOBINC/NODE/ID.json          its manifest, uploaded last: a reader lists these
    requests/JOB/latest.json              the job's newest capture request (what nodes poll)
    requests/JOB/JOBINC.json              every request, kept as the record

A job incident id (JOBINC) is shared by every node's part of one job hang.
Job names (``host:port``, run ids) are percent-encoded into one key segment.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

NO_JOB = "_none"


def seg(name: str) -> str:
    return quote(name, safe="-_.@=+") or NO_JOB


def unseg(segment: str) -> str:
    return unquote(segment)


def part(node: str, incident: str, rel: str) -> str:
    return f"nodes/{seg(node)}/incidents/{seg(incident)}/{rel}"


def manifest(job: str | None, job_incident: str, node: str, incident: str) -> str:
    return f"jobs/{seg(job) if job else NO_JOB}/{seg(job_incident)}/{seg(node)}/{seg(incident)}.json"


def jobs_prefix(job: str | None = None) -> str:
    return f"jobs/{seg(job)}/" if job else "jobs/"


def latest_request(job: str) -> str:
    return f"requests/{seg(job)}/latest.json"


def request(job: str, job_incident: str) -> str:
    return f"requests/{seg(job)}/{seg(job_incident)}.json"
