"""/proc facts: identity, job and rank, status, threads and where each sleeps in the kernel."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..host import procfs
from ..host.blocked_on import blocked_on
from ..host.deadline import Deadline
from ..model import Registration
from ..workload.runtime_files import write_json
from .base import Phase, StepFailed

# Environment keys that say which job and rank a process is.
IDENTITY_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_PROCID",
    "HOSTNAME", "POD_NAME", "POD_NAMESPACE",
})


@dataclass
class ProcStep:
    name: str = "proc"
    phase: ClassVar[Phase] = Phase.FIRST
    node: str | None = None  # the node's name in the shared store (config node_name)

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        p = target.process
        if not procfs.alive(p):
            raise StepFailed(f"pid {p.pid} started at {p.start_time} is gone")
        data = facts(target, self.node)
        if not procfs.alive(p):
            raise StepFailed(f"pid {p.pid} exited while it was being read")
        write_json(outdir / "proc.json", data)
        return ("proc.json",)


def facts(target: Registration, node: str | None) -> dict[str, object]:
    """What /proc says of a process: identity, job and rank, status, threads, what it is blocked on."""
    p = target.process
    status = procfs.status(p.pid)
    env = procfs.environ(p.pid, IDENTITY_KEYS)
    data = {
        "pid": p.pid,
        "start_time": p.start_time,
        "cmdline": list(procfs.cmdline(p.pid)) or list(target.cmdline),
        "job": target.job,
        "rank": target.rank,
        "local_rank": target.local_rank,
        "world_size": target.world_size,
        "hostname": socket.gethostname(),
        "node": node or socket.gethostname(),
        "uid": target.uid,
        "state": status.get("State"),
        "threads_count": status.get("Threads"),
        "vm_rss": status.get("VmRSS"),
        "voluntary_ctxt_switches": status.get("voluntary_ctxt_switches"),
        "nonvoluntary_ctxt_switches": status.get("nonvoluntary_ctxt_switches"),
        "environment": env,
        "threads": procfs.threads(p.pid),
        "parent": procfs.parent(p.pid),
        # The main thread's wait: the system call and the descriptor (FIFO, pipe, socket, file) behind it.
        "blocked_on": blocked_on(p.pid),
    }
    return data
