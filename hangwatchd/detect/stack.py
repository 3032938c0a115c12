"""The frozen-stack detector: low-rate py-spy samples; frozen when the same stacks hold.

A sample is one plain ``py-spy dump --json --nonblocking``: it does not pause
the target (``--native`` would, for up to a second, so it is kept for the one
look that classifies a frozen process). A process is frozen when every
sample over the window shows the same signature: each thread's frames
(function, file, line), innermost first, ignoring what does not identify
progress (thread ids, the idle/active flags). CPU time and context switches
are kept beside, as evidence.

An idle server also shows one stack for hours. So by default a frozen stack
counts only where it waits on the GPU, a collective, a lock or a known
blocking call, and does not sit in an idle pattern (an event loop waiting
for requests) - or where the user declared the process must keep moving
(``--stack-timeout``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from typing import Any

import psutil

from ..host import activity, procfs, subproc, untrusted
from ..host.peers import Looker
from ..host.pyspy_binary import find_pyspy
from ..watch.stack_history import Sample, locals_digest, signature_of
from . import pace, patterns

# Frames (Python or native) whose presence means the thread is blocked on something
# that should come (the GPU, a collective, a lock, a join), and where a server waits for
# work: from the one catalogue the GPU-dump gate and the verdict read too.
BLOCKING = patterns.blocking_patterns()
IDLE = patterns.IDLE.pattern


def counters(pid: int) -> tuple[float | None, int | None]:
    """CPU seconds (all threads) and context switches so far: the evidence beside a frozen stack."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            times, ctx = p.cpu_times(), p.num_ctx_switches()
    except (psutil.Error, OSError):
        return None, None
    return times.user + times.system, ctx.voluntary + ctx.involuntary


def take_sample(pid: int, timeout: float, native: bool = False, uid: int | None = None,
                act: activity.Activity | None = None, locals: bool = True) -> Sample:
    """One py-spy dump of ``pid``; never raises (an error is in the sample). With ``uid``, only
    while the process still runs as that user alone (checked right before py-spy attaches).
    Beside the stack: its counters (``host.activity``; ``act`` where they were read just before),
    whether a Python thread ran, a hash of its local variables (``locals``: read them), what its
    main thread was doing (``pace.main_thread``); and, for the native look at a frozen stack, what
    its sockets hold."""
    now = act.time if act is not None else time.monotonic()
    cpu, ctx = counters(pid)
    act = act if act is not None else activity.read(pid)
    tool = find_pyspy()
    if tool is None:
        return Sample(now, (), (), cpu, ctx, "py-spy is not installed; pip install py-spy")
    if uid is not None:
        try:
            untrusted.check_owner(pid, uid)
        except untrusted.Refused as exc:
            return Sample(now, (), (), cpu, ctx, f"not sampled: {exc}", refused=True)
    # --nonblocking: read without pausing the target. A frozen process reads the same either
    # way; a moving one may read torn, which only ever looks like movement.
    flags = ["--native"] if native else ["--nonblocking", "--locals"] if locals else ["--nonblocking"]
    res = subproc.run([tool, "dump", "--json", "--pid", str(pid), *flags], timeout=timeout)
    if uid is not None:
        try:  # and right after: an exec of a setuid program can land between the check and the attach
            untrusted.check_owner(pid, uid)
        except untrusted.Refused as exc:
            return Sample(now, (), (), cpu, ctx, f"not kept: {exc}", refused=True)  # what was read is dropped
    if not res.ok:
        why = "timed out and was killed" if res.timed_out else (res.stderr_line() or f"exit status {res.returncode}")
        return Sample(now, (), (), cpu, ctx, f"py-spy: {why}")
    try:
        threads = json.loads(res.stdout)
    except json.JSONDecodeError:
        return Sample(now, (), (), cpu, ctx, "py-spy printed no JSON")
    if not isinstance(threads, list):
        return Sample(now, (), (), cpu, ctx, "py-spy printed no list of threads")
    threads = [t for t in threads if isinstance(t, dict)]
    names = tuple(str(f.get("name")) for t in threads for f in t.get("frames") or [])
    running = any(t.get("active") is True for t in threads)
    io = sockets(pid, min(1.0, timeout)) if native else None
    main = pace.main_thread(threads)
    return Sample(now, signature_of(threads), names, cpu, ctx, activity=act, python_running=running,
                  locals_digest=locals_digest(threads, _helper), io=io, main=main.kind if main else None,
                  main_at=main.chain if main else ())


def carried(last: Sample, act: activity.Activity, io: dict[str, Any] | None = None) -> Sample | None:
    """``last``'s stack again, taken now without reading the process, where none of its threads has
    run since ``last`` was read (the same ``Activity.ran``): a thread that has not run cannot have
    moved its frames or rebound its locals. None where that cannot be told (a failed sample, an
    unknown digest, a thread that ran, came or went). What moves without running, the sockets'
    queues, is read anew by the caller (``io``)."""
    before = last.activity
    if last.error or before is None or before.ran is None or act.ran != before.ran:
        return None
    # No thread ran: none was on a CPU, and none of its counters but the wait for a CPU moved.
    return dataclasses.replace(last, time=act.time, activity=act, python_running=False, since=last.held_from,
                               read=False, probed=False, io=io if io is not None else last.io)


def _helper(t: dict[str, Any]) -> bool:
    name = str(t.get("thread_name") or "")
    return name != "MainThread" and bool(name) and patterns.HELPER_THREAD.search(name)


def sockets(pid: int, seconds: float) -> dict[str, Any] | None:
    """What the process's sockets hold (its listening sockets' backlogs, unread bytes): does a server have work?"""
    try:
        with Looker(time.monotonic() + seconds) as looker:
            return looker.io(pid, procfs.fd_targets(pid))
    except OSError:
        return None


def classify(frames: Sequence[str], blocking: Sequence[str] = BLOCKING, idle: str = IDLE) -> tuple[str | None, bool]:
    """(the first blocking frame, whether an idle pattern shows) for a frozen process's frames."""
    idle_re = re.compile(idle) if idle else None
    is_idle = bool(idle_re and any(idle_re.search(f) for f in frames))
    for pattern in blocking:
        rx = re.compile(pattern)
        for f in frames:
            if rx.search(f):
                return f, is_idle
    return None, is_idle
