"""Running a helper program with a deadline, killed with its whole process group past it.

Every external tool hangwatchd runs (py-spy, nvdisasm, cuda-gdb) goes through
here: the daemon must never block on something it watches.

Each tool dies with the thread that started it (PR_SET_PDEATHSIG): a daemon
killed leaves no py-spy behind, holding a process paused. The signal is set by
``setpriv --pdeathsig`` (util-linux), put in front of the tool, so that Python
starts it with vfork: a function run between fork and exec (``preexec_fn``)
makes it fork the whole daemon instead, page tables and all, which cost about
5 ms of the daemon's CPU and 5 ms of the child's on each of the four tools a
capture runs (``bench/many_hangs.py``). Where there is no setpriv, the
signal is set between fork and exec as before. (With setpriv, a daemon killed
in the moment between the start and setpriv's prctl leaves the tool to end by
itself; set between fork and exec, the child checks for that.)
"""

from __future__ import annotations

import errno
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from . import pdeathsig

_setpriv: list[str | None] = []  # the setpriv that can set the death signal, once looked for (None: none here)


def setpriv() -> str | None:
    """util-linux's setpriv, where it takes ``--pdeathsig`` (2.33 and later); None where not."""
    if not _setpriv:
        found = shutil.which("setpriv")
        if found is not None:
            try:
                ok = subprocess.run([found, "--pdeathsig", "KILL", "--", "true"], stdin=subprocess.DEVNULL,
                                    capture_output=True, timeout=5).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            found = found if ok else None
        _setpriv.append(found)
    return _setpriv[0]

MAX_OUTPUT = 32 << 20  # bytes kept of a tool's stdout (and of its stderr): py-spy of a process with thousands of threads says a few MB
READ_CHUNK = 1 << 16
REAP_WAIT = 2.0  # seconds to collect a killed tool's last output; a grandchild that escaped its group keeps the pipes, not us
# What a program that runs as a user gets of the daemon's environment: what finding and running a tool
# needs, nothing else. The rest (the shared store's keys, from the unit's root-only EnvironmentFile) stays
# the daemon's: a user reads /proc/PID/environ of any process that runs as them.
USER_ENV_KEYS = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "CUDA_HOME", "CUDA_PATH", "HANGWATCHD_NVDISASM")


def user_environment() -> dict[str, str]:
    """The part of this process's environment a program running as a user may see (``USER_ENV_KEYS``)."""
    return {k: os.environ[k] for k in USER_ENV_KEYS if k in os.environ}


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    seconds: float
    truncated: bool = False  # it wrote more than was kept, and was stopped there


    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.truncated

    def stderr_line(self) -> str:
        """What a tool says when it fails: its "Error:" line, else the last non-empty line of stderr."""
        lines = [ln.strip() for ln in self.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.lower().startswith(("error:", "fatal:"))]
        return errors[0] if errors else (lines[-1] if lines else "")


def run(
    argv: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    max_output: int = MAX_OUTPUT,
    user: int | None = None,
) -> Result:
    """Run argv (never through a shell) and return what it did within ``timeout`` seconds.

    Past it the tool's process group is killed, and what it wrote is collected for at most
    ``REAP_WAIT`` more: nothing here waits without a limit. So is a tool that writes more than
    ``max_output`` bytes (what it says of a user's process is the user's to make long): it is
    killed, its output cut there, and the result says ``truncated``. A ``timeout`` of 0 or less
    (a deadline already passed) runs nothing. ``user``: run it as that uid (its primary group, no
    others), where we are root: what it reads, it reads with that user's rights only; without an
    ``env`` of its own it gets ``user_environment()``, never the daemon's whole environment."""
    if timeout <= 0:
        return Result(tuple(argv), None, b"", b"", True, 0.0)
    start = time.monotonic()
    as_user = user if user is not None and os.geteuid() == 0 else None
    if as_user is not None and env is None:
        env = user_environment()
    proc = subprocess.Popen(  # type: ignore[call-overload]  # started holds Popen's own keywords
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        **started(argv, as_user),
    )
    assert proc.stdout is not None and proc.stderr is not None
    out, err, timed_out, truncated = _collect(proc, start + timeout, max_output)
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    try:
        proc.wait(timeout=REAP_WAIT)
    except subprocess.TimeoutExpired:
        pass  # unkillable (D state): pdeathsig and the kernel have it; we go on
    return Result(tuple(argv), proc.returncode, out, err, timed_out, time.monotonic() - start, truncated)


def started(argv: Sequence[str], user: int | None) -> dict[str, object]:
    """Popen's ``args`` and the keywords that make the tool die with us (and run as ``user``): by
    setpriv where there is one (Python then starts it with vfork), else between fork and exec."""
    tool = setpriv()
    if tool is not None:
        # As Popen would: a program that is not there raises here, not as setpriv's failure to run it.
        if shutil.which(argv[0]) is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
        as_user = ["--reuid", str(user), "--regid", str(primary_gid(user)), "--clear-groups"] if user is not None else []
        return {"args": [tool, "--pdeathsig", "KILL", *as_user, "--", *argv]}
    me = os.getpid()
    out: dict[str, object] = {"args": list(argv), "preexec_fn": lambda: pdeathsig.die_with_parent(me)}
    if user is not None:
        out.update(user=user, group=primary_gid(user), extra_groups=[])
    return out


def _collect(proc: subprocess.Popen[bytes], deadline: float, max_output: int) -> tuple[bytes, bytes, bool, bool]:
    """Both pipes read until they close, the deadline passes or the output passes ``max_output``
    (then the group is killed and what is left collected for ``REAP_WAIT``): (out, err, timed out, truncated)."""
    bufs: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}  # type: ignore[union-attr]  # started with both PIPEs
    sizes = dict.fromkeys(bufs, 0)
    open_fds = set(bufs)
    timed_out = truncated = False
    killed_at: float | None = None
    with selectors.DefaultSelector() as sel:
        for fd in open_fds:
            sel.register(fd, selectors.EVENT_READ)
        while open_fds:
            now = time.monotonic()
            if killed_at is None and (now >= deadline or truncated):
                kill_group(proc.pid)
                timed_out = not truncated
                killed_at = now
            end = deadline if killed_at is None else killed_at + REAP_WAIT
            if now >= end and killed_at is not None:
                break  # something outside its group holds the pipes open: what came is what we have
            for key, _ in sel.select(max(0.0, end - now)):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    sel.unregister(key.fd)
                    open_fds.discard(key.fd)
                    continue
                room = max_output - sizes[key.fd]
                if room > 0:
                    bufs[key.fd].append(chunk[:room])
                    sizes[key.fd] += min(len(chunk), room)
                if len(chunk) > room:
                    truncated = True
    return (b"".join(bufs[proc.stdout.fileno()]), b"".join(bufs[proc.stderr.fileno()]),  # type: ignore[union-attr]  # started with both PIPEs
            timed_out, truncated)


def primary_gid(uid: int) -> int:
    """The user's primary group (its own number, as a group, where it has no passwd entry)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid


def run_by(argv: Sequence[str], deadline: float, env: Mapping[str, str] | None = None, cwd: str | None = None,
           max_output: int = MAX_OUTPUT, user: int | None = None) -> Result:
    """``run`` cut at an absolute ``deadline`` (time.monotonic())."""
    return run(argv, deadline - time.monotonic(), env, cwd, max_output, user)


def find_tool(name: str, env_var: str, candidates: Sequence[str] = ()) -> str | None:
    """A helper program: ``$env_var`` ('none' to go without), else ``name`` on PATH, else the
    first executable of ``candidates``."""
    chosen = os.environ.get(env_var)
    if chosen:
        return None if chosen == "none" else chosen
    found = shutil.which(name)
    if found:
        return found
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
