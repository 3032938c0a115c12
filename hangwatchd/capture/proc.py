"""/proc facts: identity, job and rank, status, threads and what each waits for (and who holds the
other end of it), the process's sockets at a glance, and the CPU the scheduler gave it."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..host import procfs
from ..host.blocked_on import Waits
from ..host.deadline import Deadline
from ..host.peers import Looker
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
        # The scan of the node's descriptors may be one begun since the capture's deadline was made (the
        # hang declared): captures declared together share it. The rest of the time: writing it.
        data = facts(target, self.node, deadline.at - deadline.left() * 0.2, deadline.made)
        if not procfs.alive(p):
            raise StepFailed(f"pid {p.pid} exited while it was being read")
        write_json(outdir / "proc.json", data)
        return ("proc.json",)


def facts(target: Registration, node: str | None, end: float | None = None, since: float | None = None) -> dict[str, object]:
    """What /proc says of a process: identity, job and rank, status, threads, what each is blocked
    on and who holds the other end, its sockets, its CPU; the waits cut at ``end`` (time.monotonic()).
    ``since``: the scan of the node's descriptors may be one begun then or later (the children of
    one step share one); by default one begun now."""
    end = time.monotonic() + 2.0 if end is None else end
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
        "schedstat": procfs.schedstat(p.pid),
    }
    data.update(waits(p.pid, target.uid, data["threads"], end, since))  # type: ignore[arg-type]
    return data


def waits(pid: int, uid: int | None, threads: list[dict[str, Any]], end: float, since: float | None = None) -> dict[str, Any]:
    """``blocked_on`` (the main thread's wait: the system call and the descriptor behind it), each
    thread's own ``blocked_on`` (a running thread has none), with the other end of each wait
    (``socket``, ``peers``), and ``io``: the process's listening sockets and unread bytes.
    Threads past ``end`` are left without one, and ``waits_complete`` says so."""
    reader = Waits(pid, uid)
    main = reader.of(None)
    complete = True
    with Looker(end, since) as looker:
        for t in threads:
            if time.monotonic() > end:
                complete = False
                break
            if t.get("state") == "R":
                continue
            t["blocked_on"] = main if t.get("tid") == pid else reader.of(int(t["tid"]))
        for w in [main] + [t["blocked_on"] for t in threads if t.get("tid") != pid and "blocked_on" in t]:
            if time.monotonic() > end:
                complete = False
                break
            looker.annotate(pid, w)
        io = looker.io(pid, reader.targets()) if time.monotonic() < end else None
    return {"blocked_on": main, "io": io, "waits_complete": complete and io is not None}
