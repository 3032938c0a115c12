"""How a watched process ended, and what the daemon knew of it: for its job-mates' incidents.

``hangwatchd run`` is the only one that learns a workload's exit status (it is
the parent): it leaves ``RUNTIME_DIR/exits/PID-START.json`` behind. The
daemon sees every exit through its pidfd, keeps what it knew of the process
(rank, node, last beat, last stack) for ``exited_keep`` seconds, and when a
job-mate hangs, writes it into the incident as ``PID/exit.json``.

The exit file is written by the workload's user: it is read without
following links, without blocking, only if it is a small, shallow regular file
owned by that user (or root: the name is the daemon's choice, PID-START, never
the user's), and every field is checked. A job is (owner uid, name): a
departed process joins only its own user's job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..host import procfs, untrusted
from ..host.atomic import write_atomic
from ..model import ProcessId, Registration, is_job_mate
from . import beat_segment

MAX_FILE = 4096
MAX_DEPTH = 4  # a flat object: anything deeper is not one of ours
DIR = "exits"


@dataclass(frozen=True)
class ExitRecord:
    """How a process ended: an exit status or a signal, and when (Unix time)."""

    status: int | None
    signal: int | None
    time: float | None
    beats: int | None = None  # the segment read by the parent after the exit: fresher than the daemon's last look
    last_beat_time: float | None = None

    def describe(self) -> str:
        if self.signal is not None:
            return f"was killed by signal {self.signal} ({signal_name(self.signal)})"
        if self.status is not None:
            return f"exited with status {self.status}"
        return "exited"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def file_name(process: ProcessId) -> str:
    return f"{process.pid}-{process.start_time}.json"


def write(runtime_dir: Path, process: ProcessId, returncode: int | None, when: float, beat_file: str | None = None,
          ended_by: str | None = None) -> None:
    """The launcher's side: ``returncode`` as subprocess gives it (negative: killed by that signal).

    None: a process saying, at its own exit (atexit), that it is going; it cannot know its status.
    """
    record: dict[str, Any] = {"pid": process.pid, "start_time": process.start_time, "time": when, "status": None, "signal": None}
    if returncode is not None:
        record["status" if returncode >= 0 else "signal"] = abs(returncode)
    if ended_by:  # the daemon ended it after storing this incident (on_hang = abort)
        record["ended_by"] = {"daemon": True, "incident": ended_by}
    if beat_file:
        try:
            reading = beat_segment.read(beat_file)
            record["beats"] = reading.count
            record["last_beat_time"] = reading.wall_time()
        except beat_segment.SegmentError:
            pass
    try:
        write_atomic(runtime_dir / DIR / file_name(process), json.dumps(record).encode())
    except OSError:
        pass  # an older daemon's runtime dir without exits/: the daemon still sees the exit, without its status


def read(runtime_dir: Path, process: ProcessId, uid: int) -> ExitRecord | None:
    """The daemon's side: the record ``hangwatchd run`` left for ``process``, or None.

    Only a regular file of at most MAX_FILE bytes, owned by ``uid`` (the
    process's user) or root, naming that very process, is believed.
    """
    try:
        raw = untrusted.read_bytes(runtime_dir / DIR / file_name(process), uid, MAX_FILE)
    except untrusted.Refused:
        return None
    try:
        data = untrusted.json_object(raw, MAX_DEPTH)
    except untrusted.Refused:
        return None
    if data.get("pid") != process.pid or data.get("start_time") != process.start_time:
        return None
    status, sig, when = data.get("status"), data.get("signal"), data.get("time")
    status = status if isinstance(status, int) and not isinstance(status, bool) and 0 <= status < 256 else None
    sig = sig if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < 65 else None
    when, last = (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None
                  for v in (when, data.get("last_beat_time")))
    beats = data.get("beats")
    beats = beats if isinstance(beats, int) and not isinstance(beats, bool) and beats >= 0 else None
    return ExitRecord(status, sig, when, beats, last)


def remove(runtime_dir: Path, process: ProcessId) -> None:
    try:
        (runtime_dir / DIR / file_name(process)).unlink()
    except OSError:
        pass


def remove_stale(runtime_dir: Path, older_than: float) -> None:
    """Exit files nobody will ask for any more (their processes are long forgotten)."""
    try:
        entries = list(os.scandir(runtime_dir / DIR))
    except OSError:
        return
    for e in entries:
        try:
            if e.stat(follow_symlinks=False).st_mtime < older_than:
                os.unlink(e.path)
        except OSError:
            pass


@dataclass(frozen=True)
class Departed:
    """What the daemon knew of a watched process that exited."""

    registration: Registration
    noticed_at: float  # Unix time the daemon saw it exit
    last_beat_time: float | None
    beats: int
    last_stack: tuple[tuple[tuple[str, str, int], ...], ...] = ()  # per thread: (function, file, line), innermost first
    exit: ExitRecord | None = None
    node: str = ""

    def to_json(self) -> dict[str, Any]:
        """exit.json in the incident (docs/design.md): a job-mate that had exited."""
        r = self.registration
        e = self.exit or ExitRecord(None, None, None)
        when = e.time or self.noticed_at
        return {
            "pid": r.process.pid, "start_time": r.process.start_time, "job": r.job, "rank": r.rank,
            "local_rank": r.local_rank, "world_size": r.world_size, "node": self.node or socket.gethostname(),
            "hostname": socket.gethostname(), "cmdline": list(r.cmdline),
            "status": e.status, "signal": e.signal, "signal_name": signal_name(e.signal) if e.signal else None,
            "how": e.describe(), "time": when,
            "time_source": "hangwatchd run (the parent)" if e.time else "the daemon (its pidfd)",
            "last_beat_time": self.last_beat_time, "beats": self.beats,
            "last_stack": [[{"name": n, "filename": f, "line": ln} for n, f, ln in thread] for thread in self.last_stack],
        }


def vanished(runtime_dir: Path, registration: Registration) -> Departed | None:
    """A capture's target that is gone by the time it was captured (it exited after the hang was
    declared, or before the daemon's loop heard of it): what its launcher's exit record says, or
    that it exited; None while it still runs."""
    p = registration.process
    if procfs.start_time(p.pid) == p.start_time:
        return None
    return Departed(registration, time.time(), None, 0, exit=read(runtime_dir, p, registration.uid))


def write_into(incident_dir: Path, departed: list[Departed], hung: Registration | None = None,
               since: float | None = None) -> list[str]:
    """Each departed job-mate as ``PID/exit.json`` in the incident; returns the dirs written.

    ``hung`` and ``since``: the process whose hang made the incident and its last
    sign of progress, so that the exit can be put in time against it.
    """
    written = []
    context = {"job_hung": {"rank": hung.rank, "pid": hung.process.pid, "since": since, "declared": time.time()}} if hung else {}
    for d in departed:
        pdir = incident_dir / str(d.registration.process.pid)
        try:
            pdir.mkdir(exist_ok=True)
            write_atomic(pdir / "exit.json", json.dumps({**d.to_json(), **context}, indent=1).encode())
            written.append(pdir.name)
        except OSError:
            continue
    return written


class Departures:
    """The daemon's memory of exited processes, for ``keep`` seconds (owned by the daemon loop)."""

    def __init__(self, runtime_dir: Path, keep: float) -> None:
        self.runtime_dir = runtime_dir
        self.keep = keep
        self._gone: dict[ProcessId, Departed] = {}

    def add(self, d: Departed) -> None:
        self.expire()
        self._gone[d.registration.process] = d

    def expire(self, now: float | None = None) -> None:
        cutoff = (now or time.time()) - self.keep
        for key, d in list(self._gone.items()):
            if d.noticed_at < cutoff:
                del self._gone[key]
                remove(self.runtime_dir, key)

    def of_job(self, of: Registration) -> list[Departed]:
        """``of``'s job-mates (``model.is_job_mate``) that exited after ``of`` registered (an earlier
        run of a job of the same name is not this one), each with how it ended (read now: the
        launcher writes it just after the exit). Another user's processes that took the same job
        name, and their exit records, are never its ranks."""
        if not of.job:
            return []
        self.expire()
        out = []
        for key, d in self._gone.items():
            if not is_job_mate(of, d.registration) or d.noticed_at < of.registered_at:
                continue
            if d.exit is None:
                record = read(self.runtime_dir, key, d.registration.uid)
                if record is not None:
                    beats = record.beats if record.beats is not None else d.beats
                    last = record.last_beat_time if record.beats is not None else d.last_beat_time
                    d = Departed(d.registration, d.noticed_at, last, beats, d.last_stack, record, d.node)
                    self._gone[key] = d
            out.append(d)
        return sorted(out, key=lambda d: (d.registration.rank is None, d.registration.rank or 0, d.registration.process.pid))
