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
    """Run argv (never through a shell) and return what it did within ``timeout`` seconds."""
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
        out, err = proc.communicate()
        timed_out = True
    return Result(tuple(argv), proc.returncode, out, err, timed_out, time.monotonic() - start)


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
