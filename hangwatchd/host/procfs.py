"""Facts about a live process read from /proc, each read bounded and failure-tolerant.

/proc reads never block on the target (they are served by the kernel), so these
need no deadline of their own; a vanished process simply yields None.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..model import ProcessId

PROC = Path("/proc")
MAX_CMDLINE = 16 << 10  # bytes of a command line kept: a user's 1 MiB argument costs the daemon no more
MAX_ENVIRON = 256 << 10  # bytes of an environment read (only a few keys are kept from it)
MAX_STATUS = 16 << 10
MAX_THREADS = 4096  # threads of one process described


def read_capped(path: str | os.PathLike[str], cap: int) -> bytes:
    """At most ``cap`` bytes of a /proc file (the text a user's process controls: its command
    line, its environment). OSError when it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts, total = [], 0
        while total < cap:
            chunk = os.read(fd, min(65536, cap - total))
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first); None when it is gone.
    One read with plain os calls: the daemon asks this for every watched process, often."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rfind(b")") + 2 :].split()


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (state first: field 3 at index 0)."""
    return _stat(pid)


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot."""
    rest = _stat(pid)
    try:
        return int(rest[19]) if rest is not None else None
    except (IndexError, ValueError):
        return None


def identify(pid: int) -> ProcessId | None:
    from ..model import ProcessId  # here: `hangwatchd incidents` asks running() and pays for no records

    st = start_time(pid)
    return ProcessId(pid, st) if st is not None else None


def boot_time() -> float:
    """When this machine booted (Unix time, /proc/stat's btime): a (pid, start time) pair names one
    process only since then. 0 when it cannot be read (every incident is then looked at)."""
    try:
        for line in read_capped(PROC / "stat", 1 << 20).decode("ascii", "replace").splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def alive(proc: ProcessId) -> bool:
    """True while this very process lives (not a later one given the same pid)."""
    return running(proc.pid, proc.start_time)


def running(pid: int, started: int) -> bool:
    """True while the process ``pid`` that started at ``started`` (clock ticks since boot) lives."""
    rest = _stat(pid)
    try:
        return rest is not None and int(rest[19]) == started and rest[0] not in (b"Z", b"X")
    except (IndexError, ValueError):
        return False


def state(pid: int) -> str | None:
    rest = _stat(pid)
    return rest[0].decode() if rest else None


def uid(pid: int) -> int | None:
    """The one uid the process runs as; None when it is gone or its real, effective, saved and
    fs uids differ (a setuid program: it runs with someone else's rights, see ``untrusted``)."""
    from .untrusted import Refused, process_uid

    try:
        return process_uid(pid)
    except Refused:
        return None


def cmdline(pid: int) -> tuple[str, ...]:
    """The command line's words, the first ``MAX_CMDLINE`` bytes of it (a cut one ends in '...')."""
    try:
        raw = read_capped(PROC / str(pid) / "cmdline", MAX_CMDLINE + 1)
    except OSError:
        return ()
    cut = len(raw) > MAX_CMDLINE
    words = [p.decode("utf-8", "replace") for p in raw[:MAX_CMDLINE].split(b"\0") if p]
    if cut and words:
        words[-1] += "..."
    return tuple(words)


def environ(pid: int, keys: frozenset[str] | None = None) -> dict[str, str]:
    """The process's environment (only ``keys`` if given). Needs the same uid or ptrace rights."""
    try:
        raw = read_capped(PROC / str(pid) / "environ", MAX_ENVIRON)
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if not sep:
            continue
        key = k.decode("utf-8", "replace")
        if keys is None or key in keys:
            out[key] = v.decode("utf-8", "replace")
    return out


def threads(pid: int) -> list[dict[str, object]]:
    """Each thread's id, name, state and wchan: where in the kernel it sleeps."""
    out: list[dict[str, object]] = []
    try:
        tids = sorted(int(t) for t in os.listdir(PROC / str(pid) / "task"))[:MAX_THREADS]
    except OSError:
        return out
    for tid in tids:
        base = PROC / str(pid) / "task" / str(tid)
        try:
            stat = (base / "stat").read_bytes()
            name = stat[stat.find(b"(") + 1 : stat.rfind(b")")].decode("utf-8", "replace")
            st = stat[stat.rfind(b")") + 2 :].split()[0].decode()
            wchan = (base / "wchan").read_text().strip() if (base / "wchan").exists() else ""
        except OSError:
            continue
        out.append({"tid": tid, "name": name, "state": st, "wchan": wchan or None})
    return out


def status(pid: int) -> dict[str, str]:
    try:
        text = read_capped(PROC / str(pid) / "status", MAX_STATUS).decode("utf-8", "replace")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = v.strip()
    return out


def fd_targets(pid: int) -> dict[int, str]:
    """What each open file descriptor points at (needs the same uid or ptrace rights)."""
    out: dict[int, str] = {}
    base = PROC / str(pid) / "fd"
    try:
        fds = os.listdir(base)
    except OSError:
        return out
    for fd in fds:
        try:
            out[int(fd)] = os.readlink(base / fd)
        except (OSError, ValueError):
            continue
    return out


def fd_mode(pid: int, fd: int) -> str | None:
    """How descriptor ``fd`` of ``pid`` was opened: "r", "w" or "rw" (``fdinfo``'s flags); None
    when it is gone."""
    try:
        text = read_capped(PROC / str(pid) / "fdinfo" / str(fd), 4096)
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(b"flags:"):
            try:
                acc = int(line.split()[1], 8) & 3
            except (IndexError, ValueError):
                return None
            return {os.O_RDONLY: "r", os.O_WRONLY: "w"}.get(acc, "rw")
    return None


def thread_schedstats(pid: int) -> dict[int, tuple[int, int, int]] | None:
    """What the scheduler gave each thread (at most ``MAX_THREADS``): tid -> (ns on a CPU, ns runnable
    but waiting for one, times run). A thread's first number grows, by at least a nanosecond, each
    time it runs (``sum_exec_runtime``). None when the process is gone or no thread could be read."""
    base = f"/proc/{pid}/task/"
    try:
        tids = os.listdir(base)[:MAX_THREADS]
    except OSError:
        return None
    out: dict[int, tuple[int, int, int]] = {}
    for tid in tids:
        # Plain os calls, one read each: the stack sampler asks this of every watched process each second.
        try:
            fd = os.open(base + tid + "/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # a thread that ended while we looked
        try:
            fields = os.read(fd, 256).split()
            out[int(tid)] = (int(fields[0]), int(fields[1]), int(fields[2]))
        except (OSError, ValueError, IndexError):
            continue
        finally:
            os.close(fd)
    return out or None


def schedstat(pid: int) -> dict[str, int] | None:
    """What the scheduler gave the process, summed over its threads (``thread_schedstats``):
    ``cpu_ns`` on a CPU, ``wait_ns`` runnable but waiting for one, ``slices`` run. A thread that
    ended took its share with it. None when the process is gone or the kernel keeps no schedstats."""
    per = thread_schedstats(pid)
    return summed(per) if per else None


def summed(per_thread: dict[int, tuple[int, int, int]]) -> dict[str, int]:
    vals = per_thread.values()
    return {"cpu_ns": sum(v[0] for v in vals), "wait_ns": sum(v[1] for v in vals), "slices": sum(v[2] for v in vals)}


def held_fifos(pid: int) -> list[tuple[int, str, os.stat_result]]:
    """FIFOs the process holds open for reading: (fd, path as the process sees it, the FIFO's stat).

    The stat is of the very object behind /proc/PID/fd/N, so no path can be swapped under us.
    """
    import stat as stat_mod

    out = []
    for fd, target in fd_targets(pid).items():
        link = PROC / str(pid) / "fd" / str(fd)
        try:
            st = os.stat(link)
            flags = (PROC / str(pid) / "fdinfo" / str(fd)).read_text()
        except OSError:
            continue
        if not stat_mod.S_ISFIFO(st.st_mode):
            continue
        mode = next((int(ln.split()[1], 8) for ln in flags.splitlines() if ln.startswith("flags:")), 1)
        if mode & 3 == os.O_RDONLY:
            out.append((fd, target, st))
    return out


def gpu_device_files(pid: int, prefix: str = "/dev/nvidia") -> list[str]:
    """The GPU device files (PREFIX followed by a number: /dev/nvidia0) the process holds open, sorted:
    CUDA keeps them open for the life of the context."""
    return sorted({t for t in fd_targets(pid).values() if t.startswith(prefix) and t[len(prefix):].isdigit()})


def gpu_processes() -> list[int]:
    """Pids of the processes that hold a /dev/nvidia* device open (they use a GPU)."""
    out = []
    for entry in os.listdir(PROC):
        if not entry.isdigit():
            continue
        if any(t.startswith("/dev/nvidia") and t != "/dev/nvidiactl" for t in fd_targets(int(entry)).values()):
            out.append(int(entry))
    return out


def parent(pid: int) -> int | None:
    """Field 4 of /proc/PID/stat: the parent's pid."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """The process's children, from every thread's ``task/TID/children`` (a child belongs to the thread
    that forked it), else by scanning every process's parent."""
    out: set[int] = set()
    try:
        tids = os.listdir(PROC / str(pid) / "task")
    except OSError:
        return []
    found = False
    for tid in tids:
        try:
            text = (PROC / str(pid) / "task" / tid / "children").read_text()
        except OSError:
            continue
        found = True
        out.update(int(c) for c in text.split() if c.isdigit())
    if not found:  # a kernel without CONFIG_PROC_CHILDREN
        out = {int(e) for e in os.listdir(PROC) if e.isdigit() and parent(int(e)) == pid}
    return sorted(out)


def descendants(pid: int, limit: int) -> list[int]:
    """Children, then their children (breadth first), at most ``limit`` of them."""
    out: list[int] = []
    queue = [pid]
    while queue and len(out) < limit:
        for child in children(queue.pop(0)):
            if child not in out and child != pid:
                out.append(child)
                queue.append(child)
    return out[:limit]


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """The parent, its parent, ... up to (not including) pid 1."""
    out: list[int] = []
    p = parent(pid)
    while p and p > 1 and p not in out and len(out) < limit:
        out.append(p)
        p = parent(p)
    return out


def descends_from(pid: int, ancestor: ProcessId, max_depth: int = 64) -> bool:
    """True when ``pid`` is ``ancestor`` itself or runs somewhere below it (while it lives)."""
    if not alive(ancestor):
        return False
    return pid == ancestor.pid or ancestor.pid in ancestors(pid, max_depth)
