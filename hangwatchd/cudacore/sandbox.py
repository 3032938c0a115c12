"""Symbolising an untrusted dump in a child process with CPU, memory and wall-clock limits.

A dump in the dump dir is written by any user. Its reading is bounded by caps
in the reader, but the caps are a second line: the first is that the reading
happens in a disposable child (RLIMIT_CPU, RLIMIT_AS, a wall deadline, killed
with its process group), so a dump that still finds a way to be slow or big
costs one killed child and one line in the incident, never a daemon worker.

The children are forked from a warm fork server (multiprocessing's
"forkserver", started once with the symboliser already imported): a fresh
interpreter per dump would spend more on start-up and imports than on the
reading of a small dump. The answer comes back as JSON (never a pickle: the
child read hostile bytes) and is checked field by field into ``Symbolized``.

The child does not stay root: it opens the dump (and, for ``compress``, the
file it writes) first, then drops to the dump's owner (nobody for a root-owned
dump) with no supplementary groups before it reads a byte, so a dump that
takes over the reader gets an ordinary user's rights. Compressing a dump into
an incident runs the same way (``compress``): its own deadline and CPU limit,
one thread, so a junk "dump" cannot hold every core for minutes.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from .errors import CoreDumpError
from .symbolize import Symbolized

# What the fork server imports once, so that each child starts warm.
PRELOAD = ["hangwatchd.cudacore.sandbox", "hangwatchd.cudacore.warm"]
MAX_ANSWER_BYTES = 256 << 20  # the JSON of the biggest real dump is a few MB
_EXIT_NO_MEMORY = 86  # the child's exit status when an allocation failed under RLIMIT_AS
_EXIT_NO_DROP = 87  # the child could not drop to an unprivileged uid: it reads nothing as root
NOBODY = 65534  # who reads a root-owned dump


@dataclass(frozen=True)
class Limits:
    cpu_seconds: float = 60.0
    memory_mb: int = 4096  # the child's whole address space, the mapped dump included
    wall_seconds: float = 120.0


class SymbolizeStopped(CoreDumpError):
    """The child was stopped at a limit; the message is the line for the incident."""


_limits = Limits()


def configure(limits: Limits) -> None:
    """The limits of every later symbolize() here (the daemon sets them from its config)."""
    global _limits
    _limits = limits


def current() -> Limits:
    return _limits


def _context() -> Any:
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start() -> None:
    """Start the warm fork server now, so the first dump does not pay for it."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


def stop() -> None:
    """Stop the fork server and multiprocessing's resource tracker, and remove multiprocessing's
    temporary directory (pymp-*). They would go by themselves once this process has exited, but
    under systemd (KillMode=mixed) whatever is left when the main process exits is SIGKILLed at
    once, and the directory would stay behind in TMPDIR."""
    from multiprocessing import forkserver, resource_tracker, util

    # multiprocessing's private names (not in its type stubs): the one way to stop these before exit.
    forkserver._forkserver._stop()  # type: ignore[attr-defined]  # private, see above
    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]  # private, see above
    for finalizer in list(util._finalizer_registry.values()):  # type: ignore[attr-defined]  # private, see above
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:  # type: ignore[attr-defined]  # private, see above
            finalizer()  # runs once: removes the directory and forgets it, so exit does not try again


def symbolize(path: str | os.PathLike[str], limits: Limits | None = None, strict: bool = False,
              nvdisasm: str | None = "auto", _hook: str | None = None) -> Symbolized:
    """``cudacore.symbolize.symbolize`` in a limited child. Raises CoreDumpError with one
    line when the dump is unreadable, SymbolizeStopped when a limit stopped the child.

    _hook: tests only; "allocate" makes the child allocate without end, "sleep:PIDFILE" start
    a grandchild (its pid into PIDFILE) and sleep past the wall deadline.
    """
    lim = limits or _limits
    raw = _run(path, lim, (os.fspath(path), strict, nvdisasm, lim, _hook, None), "symbolising")
    return _decode(path, raw)


def compress(src: str | os.PathLike[str], dst: str | os.PathLike[str], level: int = 3,
             limits: Limits | None = None) -> int:
    """Compress ``src`` (a dump, read through the path of its checked fd) with zstd into ``dst``
    (a file the caller made, by the path of its fd), in a limited child; the bytes written.
    Raises SymbolizeStopped at a limit, CoreDumpError when it fails."""
    lim = limits or _limits
    raw = _run(src, lim, (os.fspath(src), False, None, lim, None, (os.fspath(dst), level)), "compressing")
    try:
        answer = json.loads(raw)
        if "error" in answer:
            if answer.get("errno"):
                raise OSError(int(answer["errno"]), str(answer["error"]))
            raise CoreDumpError(str(answer["error"]))
        return int(answer["ok"])
    except (ValueError, TypeError, KeyError) as exc:
        raise CoreDumpError(f"{src}: the compressing child's answer is unreadable ({exc})") from None


def owner_uid(path: str | os.PathLike[str]) -> int | None:
    """Who the child runs as for ``path``: its owner, nobody for root's; None when we are not root
    (an ordinary user's daemon or test has nothing to drop)."""
    if os.geteuid() != 0:
        return None
    try:
        uid = os.stat(path).st_uid
    except OSError:
        return NOBODY
    return uid or NOBODY


def _run(path: str | os.PathLike[str], lim: Limits, args: tuple[Any, ...], doing: str) -> bytes:
    import shutil
    import tempfile

    uid = owner_uid(path)
    work = tempfile.mkdtemp(prefix="hangwatchd-child-") if uid is not None else None  # removed here, however it ends
    try:
        return _run_in(path, lim, (*args, uid, work), doing)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _run_in(path: str | os.PathLike[str], lim: Limits, args: tuple[Any, ...], doing: str) -> bytes:
    ctx = _context()
    answer_r, answer_w = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(answer_w, *args), name="hangwatchd-symbolize", daemon=True)
    start_time = time.monotonic()
    try:
        child.start()
    except (OSError, EOFError) as exc:  # no fork server, no memory for a process: still one line
        answer_r.close()
        answer_w.close()
        raise CoreDumpError(f"{path}: {doing} could not start its child ({exc})") from None
    answer_w.close()
    raw: bytes | None = None
    stopped_at_wall = False
    try:
        if answer_r.poll(lim.wall_seconds):
            raw = answer_r.recv_bytes(MAX_ANSWER_BYTES)
    except EOFError:
        pass  # it died without answering: its exit status says why
    except OSError:
        _kill(child.pid)
        raise SymbolizeStopped(f"{path}: {doing} stopped: its answer was larger than "
                               f"{MAX_ANSWER_BYTES >> 20} MB") from None
    finally:
        answer_r.close()
        child.join(max(0.0, start_time + lim.wall_seconds - time.monotonic()))
        if child.exitcode is None:
            stopped_at_wall = raw is None
            _kill(child.pid)
            child.join()
        code = child.exitcode
        child.close()
    if raw is None:
        why = f"wall-clock limit of {lim.wall_seconds:g} s" if stopped_at_wall else _why(code, lim)
        raise SymbolizeStopped(f"{path}: {doing} stopped: {why}")
    return raw


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    for kill in (os.killpg, os.kill):  # its group, and itself if it had no time to make one
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _why(exitcode: int | None, lim: Limits) -> str:
    # SIGXCPU at the soft CPU limit; SIGKILL at the hard one, a second later, if it caught SIGXCPU.
    if exitcode in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"CPU limit of {lim.cpu_seconds:g} s"
    if exitcode == _EXIT_NO_MEMORY or exitcode == -signal.SIGSEGV:
        return f"memory limit of {lim.memory_mb} MB"
    if exitcode == _EXIT_NO_DROP:
        return "the child could not drop to an unprivileged uid, so it read nothing"
    return f"the symbolising child failed (exit status {exitcode})"


def _decode(path: str | os.PathLike[str], raw: bytes) -> Symbolized:
    try:
        answer = json.loads(raw)
        if "error" in answer:
            raise CoreDumpError(str(answer["error"]))
        return Symbolized.from_dict(answer["ok"])
    except CoreDumpError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise CoreDumpError(f"{path}: the symbolising child's answer is unreadable ({exc})") from None


def _gid_of(uid: int) -> int:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid  # no passwd entry: its own number, as a group too


def _drop_to(uid: int) -> None:
    """Become ``uid`` (its primary group, no others) for good: real, effective and saved ids."""
    gid = _gid_of(uid)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        raise PermissionError("the uid drop did not hold")


def _child(answer: Any, path: str, strict: bool, nvdisasm: str | None, lim: Limits, hook: str | None,
           compress_to: tuple[str, int] | None, uid: int | None, work: str | None) -> None:
    """In the child: open, drop root, limit, read, answer in JSON. Never returns an exception to the parent."""
    import resource

    os.setpgid(0, 0)  # its own group: killed with whatever it starts
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Opened while still root (the paths name the parent's checked fds), read only after the drop.
    try:
        src = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block it
        dst = os.open(compress_to[0], os.O_WRONLY | os.O_CLOEXEC) if compress_to else -1
    except OSError as exc:
        answer.send_bytes(json.dumps({"error": f"{path}: cannot be read ({exc.strerror or exc})"}).encode())
        answer.close()
        return
    if uid is not None:
        # Everything the reading needs is imported while root: after the drop the interpreter's own
        # files may be out of reach (an interpreter under root's home, as on a developer's machine).
        from . import warm  # noqa: F401 - imported for its side effect: the modules loaded before the fork
        try:
            if work is not None:  # TMPDIR may be root's alone (the systemd unit's): the child gets its own
                os.chown(work, uid, _gid_of(uid))
            _drop_to(uid)
        except OSError:
            os._exit(_EXIT_NO_DROP)
        # What it runs from here on (nvdisasm) is the user's to look at (/proc/PID/environ): none of the
        # daemon's environment (the shared store's keys) goes with it.
        from ..host.subproc import user_environment

        kept = user_environment()
        os.environ.clear()
        os.environ.update(kept)
        if work is not None:
            import tempfile

            tempfile.tempdir = work  # nvdisasm's cubins and an inflated dump go here
            os.environ["TMPDIR"] = work
    _work(answer, src, dst, path, strict, nvdisasm, lim, hook, compress_to)


def _work(answer: Any, src: int, dst: int, path: str, strict: bool, nvdisasm: str | None, lim: Limits,
          hook: str | None, compress_to: tuple[str, int] | None) -> None:
    import resource

    named, path = path, f"/proc/self/fd/{src}"  # read through the fd; named in answers as it came
    cpu = max(1, math.ceil(lim.cpu_seconds))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    memory = lim.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if compress_to:
        _compress_child(answer, src, dst, compress_to[1])
        return
    from . import nvdisasm as nvd
    from . import source

    # Nothing it starts outlives the wall deadline, and nothing inflates past what it may map.
    nvd.DEADLINE_S = min(nvd.DEADLINE_S, lim.wall_seconds)
    source.MAX_INFLATED = min(source.MAX_INFLATED, memory)
    try:
        if hook == "allocate":
            hog = [bytearray(1 << 20) for _ in range(1 << 30)]
            del hog
        elif hook and hook.startswith("sleep:"):
            import subprocess

            # A grandchild in the child's group, to show that the group goes with it.
            helper = subprocess.Popen(["sleep", str(lim.wall_seconds * 10)])
            with open(hook.split(":", 1)[1], "w") as f:
                f.write(str(helper.pid))
            time.sleep(lim.wall_seconds * 10)
        from .symbolize import symbolize

        data = symbolize(path, strict=strict, nvdisasm=nvdisasm).to_dict()
        if data.get("path") == path:
            data["path"] = named
        payload: dict[str, Any] = {"ok": data}
    except CoreDumpError as exc:
        payload = {"error": str(exc).replace(path, named)}
    except MemoryError:
        os._exit(_EXIT_NO_MEMORY)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:  # the dump could not be mapped within the address space
            os._exit(_EXIT_NO_MEMORY)
        payload = {"error": f"{named}: cannot be read ({exc.strerror or exc})"}
    except Exception as exc:  # noqa: BLE001 - a bug, but still one line in the incident, not a lost answer
        payload = {"error": f"{named}: symbolising failed ({type(exc).__name__}: {str(exc).replace(path, named)})"}
    try:
        answer.send_bytes(json.dumps(payload).encode())
    except MemoryError:
        os._exit(_EXIT_NO_MEMORY)
    answer.close()


def _compress_child(answer: Any, src: int, dst: int, level: int) -> None:
    """zstd, one thread, from ``src`` to ``dst``; the CPU and wall limits bound it."""
    import zstandard

    written = 0
    try:
        with os.fdopen(dst, "wb") as out:
            with zstandard.ZstdCompressor(level=level, threads=0).stream_writer(out, closefd=False) as z:
                offset = 0
                while chunk := os.pread(src, 4 << 20, offset):
                    offset += len(chunk)
                    z.write(chunk)
            out.flush()
            written = out.tell()
        payload: dict[str, Any] = {"ok": written}
    except MemoryError:
        os._exit(_EXIT_NO_MEMORY)
    except OSError as exc:
        payload = {"error": f"compressing failed ({exc.strerror or exc})", "errno": exc.errno}
    answer.send_bytes(json.dumps(payload).encode())
    answer.close()
