"""GPU state from NVML: utilisation, memory, power, and which GPUs the process uses.

NVML can hang on a sick GPU, and a hung call cannot be cancelled in-process,
so the probe runs as a child process with a deadline (``nvml_probe``). Where it
says NVML is not here (no library, driver or GPU), it is not asked again for
``ABSENT_FOR``: 50 hangs at once started 50 interpreters to hear it, a quarter
of the CPU of their captures on a node without GPUs (``bench/many_hangs.py``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..host import subproc
from ..host.deadline import Deadline
from ..model import Registration
from .base import Phase, StepFailed, StepNotApplicable

PROBE = Path(__file__).with_name("nvml_probe.py")
NOT_HERE = 3  # the probe's status for: no NVML library, driver or GPU on this machine
ABSENT_FOR = 600.0  # seconds the probe is not run again once it said NVML is not here (as the pace's NVML look)


@dataclass
class NvmlStep:
    name: str = "nvml"
    phase: ClassVar[Phase] = Phase.BESIDE  # it asks the driver, never the process: beside the rank's other steps
    absent: tuple[float, str] | None = field(default=None, repr=False, compare=False)  # (until when, why): not here

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        absent = self.absent
        if absent is not None and time.monotonic() < absent[0]:
            raise StepNotApplicable(absent[1])
        # By its file, not -m: importing the package hangwatchd.capture (every step, structlog,
        # prometheus_client, zstandard) cost the probe ~190 ms of its ~220 ms.
        res = subproc.run_by([sys.executable, "-P", str(PROBE), str(target.process.pid)], deadline.at)  # -P: not its dir on sys.path
        if res.timed_out:
            raise StepFailed(f"NVML did not answer within {res.seconds:.1f} s, by the capture's deadline (the probe was killed)")
        if res.returncode == NOT_HERE:
            why = res.stderr_line() or "NVML is not available here"
            self.absent = (time.monotonic() + ABSENT_FOR, why)
            raise StepNotApplicable(why)
        if res.returncode != 0:
            raise StepFailed(res.stderr_line() or f"the NVML probe failed with status {res.returncode}")
        try:
            data = json.loads(res.stdout)
        except json.JSONDecodeError:
            raise StepFailed("the NVML probe printed no JSON") from None
        (outdir / "nvml.json").write_text(json.dumps(data, indent=1))
        return ("nvml.json",)
