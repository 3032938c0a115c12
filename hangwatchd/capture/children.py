"""The hung process's own children: DataLoader and multiprocessing workers, subprocesses it waits on.

A training loop that stops because one DataLoader worker blocks in a read shows
only a parent waiting on a queue; the cause is in the child. Each descendant of
the same user (at most ``max_children``) is captured as its own ``PID/``
directory beside the parent's: ``proc.json`` (with ``parent``, ``role`` and
``blocked_on``) and py-spy's stacks, within the step's deadline. The parent's
directory gets ``children.json``: who they are, and which of them hold the
pipe or socket the parent is blocked on.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..host import blocked_on as blocked
from ..host import procfs
from ..host.deadline import Deadline
from ..model import ProcessId, Registration
from ..workload.runtime_files import write_json
from .base import Phase, StepFailed, StepNotApplicable
from .proc import facts
from .pyspy import PySpyStep

PARALLEL = 4  # children read at once; each py-spy pauses its child for a moment


@dataclass
class ChildrenStep:
    name: str = "children"
    native: bool = True
    max_children: int = 16  # a bound on the work one hung process can make the daemon do
    node: str | None = None
    phase: ClassVar[Phase] = Phase.FIRST

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        begun = time.monotonic()  # the children share one scan of the node's descriptors, begun now or later
        pid = target.process.pid
        if not procfs.alive(target.process):
            raise StepFailed(f"pid {pid} started at {target.process.start_time} is gone")
        # Only the job's own: a child of another user (a setuid helper, sudo) is not the job's to show.
        kids = [c for c in procfs.descendants(pid, self.max_children * 4) if procfs.uid(c) == target.uid]
        if not kids:
            raise StepNotApplicable(f"pid {pid} has no child processes of uid {target.uid}")
        kids = kids[: self.max_children]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(PARALLEL, len(kids)), thread_name_prefix="child") as pool:
            rows = list(pool.map(lambda c: self._one(target, c, outdir.parent, deadline, begun), kids))
        captured = [r for r, _ in (x for x in rows if x is not None)]
        _number_roles(captured)
        for row, data in (x for x in rows if x is not None):
            if data is None:
                continue
            data["role"] = row["role"]
            if procfs.alive(ProcessId(row["pid"], row["start_time"])):
                write_json(outdir.parent / row["dir"] / "proc.json", data)
            else:
                row["error"] = "exited while it was being read"
        family = [pid] + [r["pid"] for r in captured]
        mine = blocked.blocked_on(pid)
        if mine.get("object"):
            mine["held_by"] = [p for p in blocked.holders(mine["object"], family) if p != pid]
        write_json(outdir / "children.json", {"parent": pid, "blocked_on": mine, "children": captured,
                                              "more": max(0, len(procfs.descendants(pid, self.max_children + 1)) - self.max_children)})
        return ("children.json",)

    def _one(self, parent: Registration, pid: int, where: Path, deadline: Deadline,
             begun: float) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """The child's row in children.json and its proc.json (written once its role is numbered)."""
        me = procfs.identify(pid)
        if me is None:
            return None
        reg = Registration(process=me, uid=parent.uid, job=parent.job, cmdline=procfs.cmdline(pid), source="child")
        row: dict[str, Any] = {"pid": pid, "parent": procfs.parent(pid), "start_time": me.start_time}
        cdir = where / str(pid)
        try:
            cdir.mkdir()
        except FileExistsError:  # captured as a target of its own (a rank under a launcher)
            row["dir"] = None
            row["error"] = "captured as a process of its own"
            return row, None
        row["dir"] = str(pid)
        data = facts(reg, self.node, deadline.cut(2.0).at, since=begun)  # py-spy keeps the rest
        state = str(data.get("state") or "")
        threads: list[dict[str, Any]] = []
        left = deadline.left()
        if state.startswith(("Z", "X")):
            row["error"] = "exited, not yet reaped by its parent"
        elif left <= 0:
            row["error"] = "skipped: the capture's time budget was spent"
        else:
            try:
                # Two dumps (native, then plain with locals), each given half: both end by the deadline.
                PySpyStep(native=self.native, locals=True).run(reg, cdir, deadline.cut(left / 2) if self.native else deadline)
                threads = _threads(cdir)
            except StepFailed as exc:
                row["error"] = str(exc)
        comm = _comm(pid)
        cmdline = data.get("cmdline")
        row["role"] = role_of(comm, threads, cmdline if isinstance(cmdline, list) else [])
        holders = _parent_holds(data.get("blocked_on"), parent.process.pid, pid)
        blocked = data.get("blocked_on")
        if isinstance(blocked, dict) and holders:
            blocked["held_by"] = holders
        data["comm"] = comm
        row["blocked_on"] = data.get("blocked_on")
        return row, data


def _parent_holds(b: Any, parent: int, me: int) -> list[int]:
    """The parent, if it holds what the child waits on: a worker waiting on its parent's queue is idle."""
    if not isinstance(b, dict) or not isinstance(b.get("object"), list):
        return []
    return [p for p in blocked.holders(b["object"], [parent]) if p != me]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read(64).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _threads(cdir: Path) -> list[dict[str, Any]]:
    """The stacks py-spy just wrote for the child (the plain dump first: it has the locals)."""
    for name in ("pyspy.json", "pyspy-native.json"):
        try:
            data = json.loads((cdir / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, list):
            return [t for t in data if isinstance(t, dict)]
    return []


_DATALOADER = re.compile(r"torch/utils/data/")


def role_of(comm: str, threads: list[dict[str, Any]], cmdline: list[str]) -> str:
    """What the child is to the job, from its process title and its frames ("DataLoader worker 1")."""
    frames = [f for t in threads for f in t.get("frames") or [] if isinstance(f, dict)]
    for f in frames:
        if f.get("name") == "_worker_loop" and _DATALOADER.search(str(f.get("filename") or "")):
            wid = next((lv.get("repr") for lv in f.get("locals") or [] if isinstance(lv, dict) and lv.get("name") == "worker_id"), None)
            return f"DataLoader worker {wid}" if isinstance(wid, str) and wid.isdigit() else "DataLoader worker"
    if comm.startswith("pt_data_worker"):
        return "DataLoader worker"
    names = [(str(f.get("name") or ""), str(f.get("filename") or "")) for f in frames]
    if any(n.endswith("worker") and fn.endswith("multiprocessing/pool.py") for n, fn in names):
        return "multiprocessing pool worker"
    if any(fn.endswith(("multiprocessing/process.py", "multiprocessing/spawn.py")) for _, fn in names):
        return "multiprocessing worker"
    if cmdline:
        return f"subprocess {os.path.basename(cmdline[0])}"
    return f"subprocess {comm}" if comm else "subprocess"


def _number_roles(rows: list[dict[str, Any]]) -> None:
    """Workers without an id of their own are numbered by start order among their siblings, from 1
    (multiprocessing's own names count from 1: Process-1, ForkPoolWorker-1); DataLoader's from 0."""
    groups: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for r in rows:
        role = r.get("role") or ""
        if role in ("DataLoader worker", "multiprocessing pool worker", "multiprocessing worker"):
            groups.setdefault((r.get("parent"), role), []).append(r)
    for (_, role), same in groups.items():
        first = 0 if role == "DataLoader worker" else 1
        for k, r in enumerate(sorted(same, key=lambda r: (r.get("start_time") or 0, r["pid"]))):
            r["role"] = f"{role} {k + first}"
