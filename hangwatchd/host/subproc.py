"""Running a helper program with a deadline, killed with its whole process group past it.

Every external tool hangwatchd runs (py-spy, nvdisasm, cuda-gdb) goes through
here: the daemon must never block on something it watches.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from . import pdeathsig

REAP_WAIT = 2.0  # seconds to collect a killed tool's last output; a grandchild that escaped its group keeps the pipes, not us


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

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
) -> Result:
    """Run argv (never through a shell) and return what it did within ``timeout`` seconds.

    Past it the tool's process group is killed, and what it wrote is collected for at most
    ``REAP_WAIT`` more: nothing here waits without a limit. A ``timeout`` of 0 or less (a
    deadline already passed) runs nothing."""
    if timeout <= 0:
        return Result(tuple(argv), None, b"", b"", True, 0.0)
    start = time.monotonic()
    me = os.getpid()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: pdeathsig.die_with_parent(me),  # a killed daemon leaves no py-spy behind
        env=dict(env) if env is not None else None,
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        timed_out = True
        try:
            out, err = proc.communicate(timeout=REAP_WAIT)
        except subprocess.TimeoutExpired:  # something outside its group holds the pipes open
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            try:
                proc.wait(timeout=REAP_WAIT)
            except subprocess.TimeoutExpired:
                pass  # unkillable (D state): pdeathsig and the kernel have it; we go on
            out, err = b"", b""
    return Result(tuple(argv), proc.returncode, out or b"", err or b"", timed_out, time.monotonic() - start)


def run_by(argv: Sequence[str], deadline: float, env: Mapping[str, str] | None = None, cwd: str | None = None) -> Result:
    """``run`` cut at an absolute ``deadline`` (time.monotonic())."""
    return run(argv, deadline - time.monotonic(), env, cwd)


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
