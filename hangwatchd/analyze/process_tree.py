"""The process tree of a hung process: which captured child is stuck, when the parent waits for its children.

The capture puts each child of a hung process in its own ``PID/`` directory,
its ``proc.json`` naming its ``parent`` and ``role``. A parent that waits on a
queue, a join or a subprocess shows only the wait; the verdict then leads with
the child that is stuck in code of its own, and what it is blocked on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import threads as th
from .evidence import Evidence, as_int, read_json_object
from .records import RankVerdict


@dataclass(frozen=True)
class Member:
    pdir: Path
    ev: Evidence
    pid: int | None
    parent: int | None
    role: str | None


def members(dirs: list[Path], found: list[Evidence]) -> list[Member]:
    out = []
    for p, ev in zip(dirs, found):
        pid = as_int(ev.proc.get("pid")) or (int(p.name) if p.name.isdigit() else None)
        role = ev.proc.get("role") if isinstance(ev.proc.get("role"), str) else None
        out.append(Member(p, ev, pid, as_int(ev.proc.get("parent")), role))
    return out


def is_child(m: Member, pids: set[int | None]) -> bool:
    """A child captured because its parent hung (it has a role), not a rank of its own."""
    return m.role is not None and m.parent is not None and m.parent != m.pid and m.parent in pids


def as_child(v: RankVerdict, m: Member, has_children: bool) -> RankVerdict:
    """A child's own verdict, with its parent and role; a worker in its queue's wait is waiting for work."""
    v = replace(v, parent=m.parent, role=m.role)
    stuck = stuck_at(m) if v.verdict in ("idle-python", "unknown", "lock-wait", "waiting-on-children") else None
    if stuck is not None:
        frame, where = stuck
        blocked = _blocked_text(m.ev)
        return replace(v, verdict="child-stuck", detail=f"stuck in {where}" + (f", {blocked}" if blocked else ""),
                       location=f"{frame.get('name')} ({frame.get('filename')}:{frame.get('line')})" if frame else v.location)
    if v.verdict == "waiting-on-children" and not has_children:
        return replace(v, verdict="idle-python", detail=v.detail.replace("waiting for its child processes in", "waiting for work in"))
    return v


def _waits_on_parent(ev: Evidence) -> bool:
    b = ev.proc.get("blocked_on")
    return isinstance(b, dict) and bool(b.get("held_by"))


def _blocked_text(ev: Evidence) -> str | None:
    b = ev.proc.get("blocked_on")
    text = b.get("text") if isinstance(b, dict) else None
    return text if isinstance(text, str) and text not in ("running",) and not text.startswith("unknown") else None


def stuck_at(m: Member) -> tuple[dict[str, Any] | None, str] | None:
    """Where a child is stuck and a phrase for it, if it is (None: it waits for work, it is idle).

    Stuck: its main thread's innermost Python frame is its own code (a worker waiting for work sits
    in the queue's code), or it waits on one descriptor its parent does not hold (a FIFO, a file, a
    socket; a worker waiting on its parent's queue is idle, and a wait on many, poll or epoll, is
    how idle programs wait). A child with no Python stack (another program) is read by the latter.
    """
    main = th.main_thread(list(m.ev.threads), m.pid)
    frames = (main or {}).get("frames") or []
    py = next((f for f in frames if th.is_python(f)), None)
    innermost = th.innermost_user_frame(main) if main is not None else None
    if innermost is not None and id(innermost) == id(py):  # that very frame (``is`` would narrow it to py's type)
        return innermost, th.short(innermost)
    b = m.ev.proc.get("blocked_on")
    if _blocked_text(m.ev) and isinstance(b, dict) and b.get("fd") is not None and not _waits_on_parent(m.ev):
        frame = (th.innermost_user_frame(main) if main else None) or py
        return frame, th.short(frame) if frame else "a system call"
    return None


def _in_own_code(m: Member) -> bool:
    main = th.main_thread(list(m.ev.threads), m.pid)
    py = next((f for f in (main or {}).get("frames") or [] if th.is_python(f)), None)
    return main is not None and py is not None and th.innermost_user_frame(main) is py


def explain(v: RankVerdict, parent: Member, kids: list[tuple[Member, RankVerdict]]) -> RankVerdict:
    """The parent's verdict, led by its stuck child where the parent waits for its children."""
    main = th.main_thread(list(parent.ev.threads), parent.pid)
    wait = th.child_wait(main) if main else None
    held = _children_hold_parents_wait(parent.pdir, [k.pid for k, _ in kids])
    if (wait is None and not held) or not kids:  # without its children captured the parent's own verdict stands
        return v
    stuck = [(k, kv, s) for k, kv in kids if (s := stuck_at(k)) is not None]
    stuck.sort(key=lambda x: 0 if _in_own_code(x[0]) else 1)  # stuck in its own code says most
    user = th.innermost_user_frame(main) if main else None
    waits_in = (f"{th.call_name(wait)} ({os.path.basename(str(user.get('filename')))}:{user.get('line')})"
                if wait and user else th.call_name(wait) if wait else "a read of a pipe its children hold")
    loop = "the training loop" if main and any("torch/utils/data/" in str(f.get("filename")) for f in main.get("frames") or []) \
        else f"its parent (pid {parent.pid})"
    if not stuck:
        states = "; ".join(f"{k.role} (pid {k.pid}): {_blocked_text(k.ev) or kv.detail}" for k, kv in kids[:4])
        return replace(v, verdict="waiting-on-children",
                       detail=f"waiting for its {len(kids)} child process{'es' if len(kids) != 1 else ''} in {waits_in}; "
                              f"none is stuck in code of its own ({states})")
    k, kv, (frame, where) = stuck[0]
    blocked = _blocked_text(k.ev)
    own = f": {kv.detail}" if kv.verdict in ("thread-deadlock", "gil-held-in-c") else ""
    detail = (f"{k.role} (pid {k.pid}) is stuck in {where}{', ' + blocked if blocked and not own else own}; "
              f"{loop} waits for it in {waits_in}")
    if len(stuck) > 1:
        detail += "; also stuck: " + ", ".join(f"{x.role} (pid {x.pid}) in {w}" for x, _, (_, w) in stuck[1:4])
    loc = f"{frame.get('name')} ({frame.get('filename')}:{frame.get('line')})" if frame else v.location
    return replace(v, verdict="child-stuck", detail=detail, location=loc)


def _children_hold_parents_wait(pdir: Path, kids: list[int | None]) -> bool:
    """children.json says the pipe or socket the parent is blocked on is held by its children."""
    data = read_json_object(pdir / "children.json", []) or {}
    b = data.get("blocked_on")
    held = b.get("held_by") if isinstance(b, dict) else None
    return isinstance(held, list) and any(p in kids for p in held)
