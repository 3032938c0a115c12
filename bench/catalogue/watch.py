"""Running one case under the daemon and waiting for what the daemon says about it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv

from . import procs
from .cases import Case
from .score import SKIPPED, Score, score

HANG_LIMIT_S = 60.0  # after the case is hung, how long its incident may take before it is MISSED
POLL_S = 0.25
EXCEPTION_FILING_S = 60.0  # after its process ended, how long a GPU exception caught alive may take to be filed


@dataclass(frozen=True)
class Outcome:
    case: Case
    result: str
    seconds: float | None  # from the moment the case was hung to its incident's stored time
    verdict: str  # the incident's verdict, "" without one
    first: str  # its first sentence
    note: str = ""  # why it was skipped, how the case's processes ended, leaks
    incident: str = ""  # the incident's id
    leaks: tuple[str, ...] = field(default_factory=tuple)
    kind: str = ""  # the kind of verdict (docs/verdicts.md): the culprit's, or "job: ..." for a summary across ranks

    def as_json(self) -> dict[str, Any]:
        c = self.case
        return {"name": c.name, "title": c.title, "source": c.source, "healthy": c.healthy, "culprit": list(c.culprit),
                "cause": c.cause, "result": self.result, "seconds": self.seconds, "verdict": self.verdict,
                "first_sentence": self.first, "note": self.note, "incident": self.incident, "leaks": list(self.leaks),
                "kind": self.kind}


def skipped(case: Case, why: str) -> Outcome:
    return Outcome(case, SKIPPED, None, "", "", note=why)


def prefix(d: ScratchDaemon, case: Case, job: str) -> list[str]:
    """``hangwatchd run`` with the case's watch settings, up to its ``--``."""
    if case.stack_timeout is not None:
        # A long heartbeat timeout, as the tests do: the case is judged by its stack alone.
        watch = ["--stack-timeout", f"{case.stack_timeout:g}", "--heartbeat-timeout", "3600"]
    else:
        watch = ["--heartbeat-timeout", f"{case.heartbeat_timeout:g}"]
    return hangwatchd_argv("run", "--runtime-dir", str(d.runtime_dir), "--job", job, *watch, "--")


def incidents_of(d: ScratchDaemon, job: str, settled: bool = True) -> list[dict[str, Any]]:
    return [i for i in d.store().list() if i.get("job") == job and not (settled and i.get("pending"))]


def kind_of(incident: dict[str, Any]) -> str:
    """The kind of the incident's verdict: the culprit process's (analysis.ranks), or, where the summary
    speaks of ranks together, what it says of them."""
    try:
        analysis = json.loads((Path(incident["dir"]) / "incident.json").read_text()).get("analysis") or {}
    except (OSError, ValueError):
        return ""
    summary = str(analysis.get("summary") or "")
    ranks = [r for r in analysis.get("ranks") or [] if isinstance(r, dict)]
    culprits = [c for c in analysis.get("culprits") or [] if isinstance(c, dict)]
    if len(ranks) > 1:
        for words, kind in (("never entered", "ranks: never entered"), ("disagree", "ranks: disagree"),
                            ("exited", "ranks: exited"), ("odd one out", "ranks: odd one out")):
            if words in summary:
                return kind
    pid = culprits[0].get("pid") if culprits else None
    rank = next((r for r in ranks if r.get("pid") == pid), ranks[0] if ranks else {})
    return str(rank.get("verdict") or "")


def verdict_of(incident: dict[str, Any]) -> str:
    try:
        return str(json.loads((Path(incident["dir"]) / "incident.json").read_text()).get("verdict") or "")
    except (OSError, ValueError):
        return str(incident.get("summary") or "")


def run_case(d: ScratchDaemon, case: Case, logdir: Path, tag: str) -> Outcome:
    """Start the case under the daemon, wait for its incident (or its observation to pass), end it."""
    job = f"cat-{case.name}-{tag}"
    run = procs.start(case, prefix(d, case, job), logdir)
    try:
        if case.healthy:
            found = _watch_healthy(d, run, job)
        else:
            found = _wait_for_incident(d, run, job)
        ended = _how_it_ended(run)
    finally:
        leaks = procs.stop(run)
    verdict = verdict_of(found) if found else None
    s: Score = score(verdict, case.culprit, case.cause, case.healthy)
    seconds = round(float(found["time"]) - run.hung_at, 1) if found else None
    note = "; ".join(x for x in (ended, *(f"leaked {x}" for x in leaks)) if x)
    return Outcome(case, s.result, seconds, verdict or "", s.first, note, found["id"] if found else "", tuple(leaks),
                   kind_of(found) if found else "")


def _wait_for_incident(d: ScratchDaemon, run: procs.Running, job: str) -> dict[str, Any] | None:
    deadline = run.hung_at + HANG_LIMIT_S
    while time.time() < deadline:
        found = incidents_of(d, job)
        if found:
            return found[-1]  # the oldest: the first the daemon stored for this job
        if not run.alive():
            # Every rank is gone: nothing is left to hang. Give a capture in flight a moment; an exception
            # caught alive (the driver ends the process once its dump is read) is still being filed.
            end = time.time() + (EXCEPTION_FILING_S if _exception_caught(d, job) else 2.0)
            while not (found := incidents_of(d, job)) and time.time() < end:
                time.sleep(POLL_S)
            return found[-1] if found else None
        time.sleep(POLL_S)
    return None


def _exception_caught(d: ScratchDaemon, job: str) -> bool:
    """Whether the daemon caught a GPU exception of the job alive (its log says so): its incident comes
    once the dump is read and symbolised, after the process has ended."""
    return any(e.get("event") == "exception_begun" and e.get("job") == job for e in d.logs())


def _watch_healthy(d: ScratchDaemon, run: procs.Running, job: str) -> dict[str, Any] | None:
    deadline = run.started + run.case.observe
    while time.time() < deadline:
        found = incidents_of(d, job, settled=False)
        if found:
            # A false alarm: wait for its verdict to be in, for the report.
            end = time.time() + 30
            while time.time() < end and not incidents_of(d, job):
                time.sleep(POLL_S)
            return (incidents_of(d, job) or found)[-1]
        time.sleep(POLL_S)
    return None


def _how_it_ended(run: procs.Running) -> str:
    """A word on ranks that exited before the runner ended them (a hang case should not)."""
    gone = [(i, p.returncode) for i, p in enumerate(run.procs) if p.poll() is not None]
    if not gone:
        return ""
    if run.case.ranks == 1:
        return f"the case exited with status {gone[0][1]} before it was ended"
    return "; ".join(f"rank {i} exited with status {rc}" for i, rc in gone)
