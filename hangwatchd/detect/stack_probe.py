"""A long-lived reader that tells, without a py-spy run, whether a process's Python state moved.

A stack sample of a process whose threads ran since its last read needs a new read: a thread
that ran may have moved its frames or rebound its locals. Most of those processes did not: a
loop that wakes every few seconds to check a flag, a server's poll, a watchdog's sleep. A
py-spy run costs a fork, an exec and the load of the interpreter's symbols (about 10 ms of CPU,
more for a statically linked interpreter); at a thousand processes watched by their stacks, a
hundred of them waking now and then, that alone is a fifth of a core.

So one helper process, started once and kept (``python -m hangwatchd.detect.stack_probe``),
reads each such process with pystack (``get_process_threads``, without stopping it: the same
``process_vm_readv`` reads py-spy's ``--nonblocking`` makes) and answers with a digest of its
Python state: each Python thread's id, its frames (file, function, line) and the reprs of their
local variables, and whether a thread ran while it was read (then the digest counts for nothing:
pystack reads a running frame's locals torn). The sampler compares the digest
with the one read when py-spy last read the process: the same digest carries py-spy's last
sample forward (its frames and names are py-spy's, which the patterns and verdicts read);
another digest, or none, and py-spy reads it as before. Nothing the helper reads reaches the
daemon but that digest and a flag.

The helper is the daemon's child, as root, like py-spy: it dies with the daemon (setpriv's
death signal). Unlike py-spy, which opens ``/proc/PID/exe`` alone, pystack opens the
interpreter's files by the names /proc gives, and the debug files named beside them: names the
process's user chooses (a binary deleted after its exec is ``DIR/python3 (deleted)``, which the
user may then create as a symlink or a FIFO). So each process is read with its user's rights to
open files (``setfsuid``/``setfsgid``, no supplementary groups; root's right to read its memory
kept): a name the user planted leads nowhere the user could not open. Its address space is capped (``MAX_BYTES``), and each answer is awaited until the
sample's deadline only: past it, or on anything but one well-formed line, the helper is killed
with its process group and started again on the next probe. One probe at a time: a sample that
finds the helper busy waits for it at most ``WAIT_BUSY`` (a probe takes milliseconds) and then
goes to py-spy, so one user's process that reads slowly never holds up the samples of anyone
else's for longer than that; and a user whose process
the helper was killed over is not probed for a minute (``SHUN_SECONDS``), so one user cannot keep
it dying until it rests (six restarts a minute) for everyone. Where pystack is not
installed, or cannot read this interpreter, the first answer says so and every sample is read
by py-spy, as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from ..host import procfs, subproc, untrusted

log = structlog.get_logger("hangwatchd.daemon")

MAX_BYTES = 1 << 30  # the helper's address space (pystack maps the target's binaries to read their symbols)
MAX_LINE = 4096  # bytes of one answer
MAX_THREADS = 1024  # threads of one process digested
MAX_REPR = 1024  # characters of a local's repr: a longer one, and no digest (pystack's are 80 at most)
# How pystack says it did not read a value whole: a string cut at 80 characters ends with "...", a
# container cut short ends with "...]", "...}" or "...)", an int past 2**63 is not read at all. Two
# values that differ past the cut read the same; py-spy's digest has each value's address and sees
# a name rebound, so where pystack cut a value, the probe cannot say "same": no digest, py-spy reads.
ELIDED = ("...", "...]", "...}", "...)")
UNREAD = "<UNRESOLVED"
START_TIMEOUT = 10.0  # seconds for the helper to start and say it can read
RESTARTS_PER_MINUTE = 6  # more, and the probe rests for a minute (py-spy reads meanwhile)
WAIT_BUSY = 0.5  # seconds a sample waits for the helper busy with another before py-spy reads it
SHUN_SECONDS = 60.0  # a user's process the helper was killed over: that user's are not probed for this long


@dataclass(frozen=True)
class Probed:
    """What the helper read of one process: the digest of its Python state, and whether a thread of
    it ran during the read or was on a CPU at either end of it (then the digest says nothing)."""

    state: str
    running: bool


# -- the helper ------------------------------------------------------------------------------


def _threads(pid: int) -> tuple[object, bool]:
    """(each thread's counters from the scheduler, whether a thread is on a CPU now): what says
    whether the process ran while it was read."""
    return procfs.thread_schedstats(pid), any(t["state"] == "R" for t in procfs.threads(pid))


def _owner(pid: int) -> tuple[int, int]:
    """(uid, gid) a process runs as: its one uid (a setuid process has none and is refused) and its
    real gid."""
    return untrusted.process_uid(pid), int(procfs.status(pid)["Gid"].split()[0])


_libc = ctypes.CDLL(None, use_errno=True)


def _files_as(uid: int, gid: int) -> None:
    """This thread's files opened with ``uid``'s and ``gid``'s rights from now (setfsuid, setfsgid):
    its ptrace rights, which read the process's memory, are root's still."""
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    if _libc.setfsuid(-1) != uid or _libc.setfsgid(-1) != gid:  # -1: only the one in force, returned
        raise PermissionError(f"cannot open files as uid {uid} gid {gid}")


def digest(pid: int) -> Probed:
    """The helper's reading of ``pid`` (raises where pystack cannot read it), its files opened with
    the rights of the user the process runs as: pystack opens the interpreter's binary and its
    debug files by the names /proc gives (``DIR/python3 (deleted)``, ``DIR/DEBUGLINK``), names the
    user chooses, so as root it would open whatever that user put there (root's files, devices)."""
    uid, gid = _owner(pid)
    me, mine = os.geteuid(), os.getegid()
    try:
        _files_as(uid, gid)
        return _digest(pid)
    finally:
        _files_as(me, mine)


def _digest(pid: int) -> Probed:
    from pystack.engine import StackMethod, get_process_threads

    h = hashlib.blake2b(digest_size=16)
    before = _threads(pid)
    for n, thread in enumerate(get_process_threads(pid, stop_process=False, method=StackMethod.AUTO, locals=True)):
        if n >= MAX_THREADS:
            break
        h.update(f"T{thread.tid}".encode())
        for frame in thread.frames:
            code = frame.code
            h.update(f"F{code.filename}\0{code.scope}\0{code.location.lineno}".encode("utf-8", "replace"))
            for name, value in sorted({**frame.arguments, **frame.locals}.items()):
                text = str(value)
                if len(text) > MAX_REPR or text.endswith(ELIDED) or text.startswith(UNREAD):
                    raise ValueError(f"pystack did not read {name!r} whole ({text[:40]!r}): only py-spy can tell if it moved")
                h.update(f"L{name}\0{text}".encode("utf-8", "replace"))
    # A thread that ran during the read, or was on a CPU at either end of it, may have been read torn:
    # pystack reads a running frame's locals from its value stack half the time (a loop's counter read
    # as the same stale int, read after read), which would say "same" of a process that computes.
    after = _threads(pid)
    running = after[0] != before[0] or before[1] or after[1]
    return Probed(h.hexdigest(), running)


def serve() -> None:
    """The helper's loop: a pid a line in, one JSON line out (``{"state", "running"}`` or ``{"error"}``)."""
    resource.setrlimit(resource.RLIMIT_AS, (MAX_BYTES, MAX_BYTES))
    # pystack crashes on some stacks a user can build (5,000 frames deep: SIGSEGV); what the helper
    # holds, read from every user's processes, is never written out as a core of root's.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() == 0:
        os.setgroups([])  # a file of root's group is not readable through a user's filesystem rights either
    out = sys.stdout
    try:
        import pystack.engine  # noqa: F401 - only whether it is there
    except ImportError as exc:
        out.write(json.dumps({"error": f"pystack is not installed ({exc})"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            pid = int(line)
            got = digest(pid)
            answer = {"pid": pid, "state": got.state, "running": got.running}
        except Exception as exc:  # noqa: BLE001 - the target's trouble is this answer's, never the helper's end
            answer = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


# -- the daemon's side ------------------------------------------------------------------------


class StackProbe:
    """The daemon's handle on the helper: ``probe(pid, deadline)``, from any thread, one at a time.
    ``argv``: the helper's command (this module's ``serve`` by default)."""

    def __init__(self, argv: Sequence[str] | None = None) -> None:
        package = str(Path(__file__).resolve().parents[2])
        self.argv = list(argv) if argv is not None else [
            sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
            "from hangwatchd.detect.stack_probe import serve; serve()", package]
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self.unavailable: str | None = None  # why it cannot read here (then py-spy reads everything)
        self._restarts: list[float] = []
        self._rest_until = 0.0
        self._shunned: dict[int, float] = {}  # uid: monotonic time its processes may be probed again
        self.probes = 0  # answered
        self.failures = 0  # killed past a deadline or after a bad answer

    def probe(self, pid: int, deadline: float, uid: int | None = None) -> Probed | None:
        """The digest of ``pid``'s Python state, read by the helper before ``deadline`` (monotonic);
        None when the helper stays busy for ``WAIT_BUSY``, rests, cannot read here, or cannot read this process.
        ``uid``: the user whose process it is. Where the helper is killed over one (no answer by the
        deadline: a FIFO planted where pystack opens a file, say), that user's processes are not
        probed for ``SHUN_SECONDS`` (py-spy reads them), so one user's processes cannot keep the
        helper dying until it rests for everyone."""
        if self.unavailable is not None or not self._lock.acquire(timeout=max(0.0, min(WAIT_BUSY, deadline - time.monotonic()))):
            return None
        try:
            now = time.monotonic()
            if now < self._rest_until or (uid is not None and now < self._shunned.get(uid, 0.0)):
                return None
            if self._proc is None and not self._start(min(deadline, now + START_TIMEOUT)):
                return None
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(b"%d\n" % pid)
                self._proc.stdin.flush()
            except OSError:
                self._kill("it stopped taking requests")
                return None
            failures = self.failures
            answer = self._answer(deadline)
            if answer is None:
                if uid is not None and self.failures > failures:
                    self._shun(uid)
                return None
            state = answer.get("state")
            if answer.get("pid") != pid or not isinstance(state, str):
                return None  # pystack could not read this one (gone, another interpreter): py-spy will say
            self.probes += 1
            return Probed(state, answer.get("running") is True)
        finally:
            self._lock.release()

    def _shun(self, uid: int) -> None:
        now = time.monotonic()
        self._shunned = {u: t for u, t in self._shunned.items() if t > now}  # the users of a node: few
        self._shunned[uid] = now + SHUN_SECONDS
        log.warning("stack_probe_user_skipped", uid=uid, seconds=SHUN_SECONDS,
                    why="the helper was killed reading a process of theirs; py-spy reads them meanwhile")

    def _start(self, deadline: float) -> bool:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0]
        if len(self._restarts) >= RESTARTS_PER_MINUTE:
            self._rest_until = now + 60.0
            log.warning("stack_probe_resting", why=f"restarted {len(self._restarts)} times in a minute", seconds=60)
            self._restarts.clear()
            return False
        self._restarts.append(now)
        try:
            self._proc = subprocess.Popen(  # type: ignore[call-overload]  # started holds Popen's own keywords
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                cwd="/", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, **subproc.started(self.argv, None))
        except OSError as exc:
            self.unavailable = f"the helper did not start: {exc}"
            log.warning("stack_probe_unavailable", why=self.unavailable)
            return False
        self._buf = b""
        hello = self._answer(deadline)
        if hello is None or hello.get("ready") is not True:
            why = hello.get("error") if hello is not None else None
            if isinstance(why, str):
                self.unavailable = why
                log.info("stack_probe_unavailable", why=self.unavailable, fallback="py-spy reads every sample")
                self._kill(None)
            return False
        return True

    def _answer(self, deadline: float) -> dict[str, object] | None:
        """One line from the helper before ``deadline``; the helper killed where none comes whole."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or len(self._buf) > MAX_LINE:
                self._kill("no answer before the sample's deadline" if left <= 0 else "an answer too long")
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, MAX_LINE)
            if not chunk:
                self._kill("it ended")
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            self._kill("an answer that is not one JSON object")
            return None
        return answer

    def _kill(self, why: str | None) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if why is not None:
            self.failures += 1
            log.info("stack_probe_restarted", why=why, pid=proc.pid)
        subproc.kill_group(proc.pid)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        try:
            proc.wait(timeout=subproc.REAP_WAIT)
        except subprocess.TimeoutExpired:
            pass  # unkillable (D state): its death signal and the kernel have it

    def close(self) -> None:
        with self._lock:
            self._kill(None)


if __name__ == "__main__":
    serve()
