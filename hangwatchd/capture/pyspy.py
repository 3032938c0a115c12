"""Python stacks with py-spy: ``--native`` first (C/C++/CUDA frames), then plain.

py-spy pauses the target while it reads; ``--native`` can take over a second
on a hung PyTorch process. Each run has its own deadline and is killed with
its process group past it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..host import native_frames, procfs, subproc, untrusted
from ..host.deadline import Deadline
from ..host.pyspy_binary import find_pyspy, ptrace_hint
from ..model import Registration
from .base import Phase, StepFailed

RETRIES = 3  # more reads of a process whose threads moved under py-spy's read, within the run's deadline


@dataclass
class PySpyStep:
    native: bool = True
    nonblocking: bool = False  # read without pausing the process (a slow job's ranks; a torn read is possible)
    name: str = "pyspy"
    locals: bool = False  # the plain dump also takes each frame's local variables (a worker's id)
    phase: ClassVar[Phase] = Phase.FIRST

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        tool = find_pyspy()
        if tool is None:
            raise StepFailed("py-spy is not installed; pip install py-spy")
        pid = target.process.pid
        # One deadline for both runs, never the whole timeout twice: the native run may take two
        # thirds of it, so a plain dump after a native one that hung still gets the rest.
        timeout = deadline.left()
        native_by = deadline.sooner(timeout / 3)
        errors: list[str] = []
        files: list[str] = []
        for native, name in ((True, "pyspy-native.json"), (False, "pyspy.json")):
            if native and not self.native:
                continue
            if not procfs.alive(target.process):
                raise StepFailed(f"pid {pid} started at {target.process.start_time} is gone")
            try:  # right before py-spy attaches, as root: a process that exec'd a setuid program is not read
                untrusted.check_owner(pid, target.uid)
            except untrusted.Refused as exc:
                raise StepFailed(f"not read: {exc}") from None
            argv = [tool, "dump", "--json", "--pid", str(pid)] + (["--native"] if native else ["--locals"] if self.locals else [])
            if self.nonblocking and not native:
                argv.append("--nonblocking")  # a rank that is slow, not hung: never paused
            until = native_by.at if native else deadline.at
            res = subproc.run_by(argv, until)
            for _ in range(RETRIES):
                # py-spy reads the interpreter's threads while they move: a process starting or ending
                # threads (a torch rank's pools) fails a read now and then; a read a moment later works.
                if res.ok or res.timed_out or b"Failed to get stack traces" not in res.stderr or time.monotonic() > until - 0.5:
                    break
                time.sleep(0.1)
                res = subproc.run_by(argv, until)
            label = "py-spy --native" if native else "py-spy"
            if res.timed_out:
                errors.append(f"{label} was killed at its deadline ({res.seconds:.1f} s of the step's {timeout:g} s)"
                              if res.returncode is not None else f"{label} did not start: the step's deadline had passed")
                continue
            if not res.ok:
                errors.append(f"{label}: {self._why(res.stderr_line(), res.stderr.decode('utf-8', 'replace'), res.returncode)}")
                continue
            try:
                stacks = json.loads(res.stdout)
            except json.JSONDecodeError:
                errors.append(f"{label} printed no JSON")
                continue
            if native and isinstance(stacks, list):
                # A process in another mount namespace maps files py-spy cannot open by name.
                native_frames.name_unknown_frames(pid, stacks, deadline.at)
            (outdir / name).write_text(json.dumps(stacks, indent=1))
            files.append(name)
        if not procfs.alive(target.process):
            # The pid may now be another program's: what we read cannot be trusted as this one's.
            for name in files:
                (outdir / name).unlink(missing_ok=True)
            raise StepFailed(f"pid {pid} exited or was reused during the dump")
        if not files:
            raise StepFailed("; ".join(errors))
        if errors:
            (outdir / "pyspy-errors.txt").write_text("\n".join(errors) + "\n")
            files.append("pyspy-errors.txt")
        return tuple(files)

    @staticmethod
    def _why(line: str, stderr: str, code: int | None) -> str:
        low = stderr.lower()
        if "permission denied" in low or "operation not permitted" in low:
            return f"{line} ({ptrace_hint()})"
        if "failed to find python version" in low or "not a python" in low:
            return f"{line} (not a Python program)"
        return line or f"exit status {code}"
