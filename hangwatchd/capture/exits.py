"""The processes below a hung one that ended in the last minutes, and how: ``exits.json``.

A parent that waits in ``Pool.map`` or on a DataLoader's queue for a worker the OOM killer took
shows only its wait; the worker is gone, reaped, and absent from /proc. The daemon's listener
(``host/proc_exits``) saw it end: its pid, name, exit status or signal, and when. Only the exits
of the process's own user are shown (a process of another user below it, a setuid helper, is
counted in ``not_shown``); root's processes see all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..host.deadline import Deadline
from ..host.proc_exits import ProcExits
from ..model import Registration
from ..workload.runtime_files import write_json
from .base import Phase, StepNotApplicable


@dataclass
class ExitsStep:
    name: str = "exits"
    listener: ProcExits | None = None  # the daemon's; None where nothing listens (hangwatchd capture)
    window: float = 600.0  # seconds back from the capture
    phase: ClassVar[Phase] = Phase.FIRST  # what the kernel recorded already: read in a moment, before the incident

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        if self.listener is None:
            raise StepNotApplicable("no listener for process exits (only the daemon runs one)")
        if not self.listener.on:
            raise StepNotApplicable(f"process exits are not recorded here: {self.listener.off}")
        now = time.time()
        since = now - self.window
        rows = self.listener.exits_below(target.process.pid, since)
        shown = rows if target.uid == 0 else [r for r in rows if r["uid"] == target.uid]
        write_json(outdir / "exits.json", {
            "pid": target.process.pid,
            "window_s": self.window,
            "since": round(since, 3),
            "listening_since": self.listener.started_at,  # nothing before it is known
            "lost": self.listener.lost,  # times the kernel dropped events: some exits may be missing
            "exits": shown,
            "not_shown": len(rows) - len(shown),
        })
        return ("exits.json",)
