"""What a process did between two looks, from counters it cannot move while it waits.

A stack that holds still proves little on its own: a checkpoint written by one
long C call, a compile, a collective computed by the library's own threads, a
worker pool feeding the main thread every few seconds, a child that compiles
all show one stack for a while. What moves while they work and stands still
in a hang is read here, cheaply, at each stack sample:

- the CPU its threads had and the CPU they waited for (``schedstat``: time on
  a CPU and time runnable on a run queue; on a loaded node the second grows
  where the first cannot, so the two together say how much CPU it *wanted*);
- the bytes it read and wrote (``/proc/PID/io``: ``rchar``, ``wchar``; a
  consumer that gets an item reads it, a checkpoint writes);
- the CPU its descendants had (a child that compiles, a worker that decodes).

Beside them, ``ran``: a digest of each thread's own CPU time. A thread's time on a CPU grows,
by at least a nanosecond, every time it runs; a thread that has not run cannot have moved its
stack, its local variables or anything else of its own. So two looks with the same ``ran``
(the same threads, none of which ran in between) see the same stack: the stack sampler reads it
once and carries it forward while the process stands still (``detect/stack.py``).

All reads are of the kernel's own counters (/proc), bounded, and never block
on the process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from . import procfs

MAX_DESCENDANTS = 64
TICK_NS = 10**9 // 100  # /proc/PID/stat counts CPU in clock ticks of 1/100 s (USER_HZ)


@dataclass(frozen=True)
class Activity:
    time: float  # monotonic
    cpu_ns: int | None  # on a CPU, all its threads (those alive at the look)
    wait_ns: int | None  # runnable but waiting for a CPU, all its threads
    io_bytes: int | None  # read and written (rchar + wchar)
    kids_cpu_ns: int  # its descendants' CPU (user + system), alive at the look
    kids: int  # how many descendants were read
    kids_wait_ns: int = 0  # the time its descendants' main threads waited for a CPU (a loaded node)
    ran: int | None = None  # digest of (thread, its CPU ns) of every thread: unchanged while none of them runs
    threads: int = 0  # its threads at the look


def read(pid: int) -> Activity:
    """The counters of ``pid`` now (None where a counter cannot be read: another user's io without
    rights, a kernel without schedstats)."""
    now = time.monotonic()
    per = procfs.thread_schedstats(pid)
    sched = procfs.summed(per) if per else None
    kids = procfs.descendants(pid, MAX_DESCENDANTS)
    return Activity(now, sched.get("cpu_ns") if sched else None, sched.get("wait_ns") if sched else None,
                    io_bytes(pid), sum(cpu_ns(k) for k in kids), len(kids),
                    kids_wait_ns=sum(leader_wait_ns(k) for k in kids), ran=digest(per), threads=len(per) if per else 0)


def ran(pid: int) -> int | None:
    """``Activity.ran`` alone, read now: the cheap look the stack sampler takes every second."""
    return digest(procfs.thread_schedstats(pid))


def digest(per_thread: dict[int, tuple[int, int, int]] | None) -> int | None:
    """One number for which threads there are and how long each has run; None when unknown (no
    thread read, or a kernel that counts no thread's CPU time: nothing can be told from it)."""
    if not per_thread or not any(v[0] for v in per_thread.values()):
        return None
    return hash(tuple(sorted((tid, v[0]) for tid, v in per_thread.items())))


def io_bytes(pid: int) -> int | None:
    try:
        text = procfs.read_capped(f"/proc/{pid}/io", 4096).decode("ascii", "replace")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["rchar"]) + int(fields["wchar"])
    except (KeyError, ValueError):
        return None


def cpu_ns(pid: int) -> int:
    """User and system CPU of ``pid`` (all its threads, the ended ones too), from /proc/PID/stat."""
    rest = procfs.stat_fields(pid)
    try:
        return (int(rest[11]) + int(rest[12])) * TICK_NS if rest else 0
    except (IndexError, ValueError):
        return 0


def leader_wait_ns(pid: int) -> int:
    """How long the main thread of ``pid`` waited, runnable, for a CPU (/proc/PID/schedstat); 0 unknown."""
    try:
        return int(procfs.read_capped(f"/proc/{pid}/schedstat", 256).split()[1])
    except (OSError, ValueError, IndexError):
        return 0
