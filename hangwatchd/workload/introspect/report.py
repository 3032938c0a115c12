"""The report the daemon asks for: every thread with what it waits on and holds, every lock with
its holders, the threads that ended, asyncio loops and tasks, pools and children.

Built in the reporter's thread, from copies taken in single C calls
(``sys._current_frames()``, ``dict(threading._active)``: ``threading.enumerate()``
would take a lock the program may hold), within ``CPU_BUDGET`` seconds of CPU:
past it, what is left is left out and ``truncated`` says so. Every section is
built in its own ``try``: a section that fails is an ``errors`` line, never a
missing report. The document is capped at ``MAX_BYTES``: frames are cut first,
then threads and tasks.
"""

from __future__ import annotations

import _thread
import ast
import json
import os
import sys
import threading
import time
import types
import weakref
from typing import Any

from . import graph_replays, loops, objects, pools, source, sync, tasks_ended, threads, waits
from .source import MISSING, Scope, Sources

VERSION = 1
MAX_THREADS = 256
MAX_FRAMES = 64
MAX_BYTES = 2 << 20
CPU_BUDGET = 1.0  # seconds of this thread's CPU


class Locks:
    """Every lock-like object seen in a wait or a hold, keyed by its id."""

    def __init__(self, ctx: waits.Context) -> None:
        self.ctx = ctx
        self.rows: dict[str, dict[str, Any]] = {}

    def row(self, obj: object, kind: str, expr: str | None) -> dict[str, Any]:
        key = objects.hex_id(obj)
        row = self.rows.get(key)
        if row is None:
            row = {"kind": kind, "expr": expr, "holders": [], "waiters": [], "holder_tasks": [], "waiter_tasks": []}
            row.update(sync.detail(obj, kind, self.ctx.known, self.ctx.live))
            self.rows[key] = row
        elif row.get("expr") is None:
            row["expr"] = expr
        return row


def _frames(frames: list[types.FrameType]) -> list[dict[str, Any]]:
    return [waits.where(f) for f in frames[:MAX_FRAMES]]


def _thread_entry(ident: int, frames: list[types.FrameType], thread: object, main_ident: object,
                  ctx: waits.Context, locks: Locks, waited: list[object]) -> dict[str, Any]:
    d = objects.instance_dict(thread) if thread is not None else None
    d = d or {}
    entry: dict[str, Any] = {
        "ident": ident, "native_id": d.get("_native_id"), "name": objects.text(d.get("_name")),
        "daemon": d.get("_daemonic") is True, "main": ident == main_ident, "started": threads.started_at.get(ident),
        "python_thread": thread is not None,
        "target": threads.target_info(thread) if thread is not None else None,
        "frames": _frames(frames), "more_frames": max(0, len(frames) - MAX_FRAMES),
        "graph_replay": graph_replays.of_thread(ident),
        "waits": None, "holds": [],
    }
    try:
        w = waits.thread_wait(frames, ctx)
    except Exception as exc:  # noqa: BLE001 - a wait we cannot read is an error in the report, never a missing report
        w = {"kind": None, "error": f"{type(exc).__name__}"}
    entry["waits"] = w
    held: list[tuple[object, str, str, dict[str, Any], types.FrameType]] = []
    for f in frames:
        try:
            for obj, kind, expr, how in waits.frame_holds(f, f.f_lineno, ctx):
                held.append((obj, kind, expr, how, f))
        except Exception:  # noqa: BLE001 - a frame we cannot read holds nothing we know of
            continue
    waited_id = w.get("id") if w else None
    for obj, kind, expr, how, f in held:
        key = objects.hex_id(obj)
        if w and w.get("kind") == "condition" and key == waited_id and not w.get("detail", {}).get("acquiring"):
            continue  # Condition.wait released it: waiting is not holding
        entry["holds"].append(waits.hold_row(obj, kind, expr, how, f, f.f_lineno))
        row = locks.row(obj, kind, expr)
        if ident not in row["holders"]:
            row["holders"].append(ident)
    obj = w.pop("_obj", None) if w else None
    if obj is not None and w is not None:  # an object only ever comes out of a wait
        waited.append(obj)
        if w.get("kind") in sync.LOCK_KINDS:
            locks.row(obj, w["kind"], w.get("expr"))["waiters"].append(ident)
    return entry


def _exited(ctx: waits.Context) -> list[dict[str, Any]]:
    out = []
    for rec in list(threads.ended):
        row = {k: v for k, v in rec.items() if not k.startswith("_")}
        scope = rec.get("_code")
        if scope and row.get("target"):
            row["target"] = dict(row["target"], acquires=_acquires(scope, ctx))
        out.append(row)
    return out


def _acquires(scope: tuple[types.CodeType, dict[str, object], weakref.ref[object] | None], ctx: waits.Context) -> list[dict[str, Any]]:
    """The bare ``EXPR.acquire()`` calls in an ended thread's code, each EXPR evaluated now where it can be
    (a module's lock, the thread's own self._lock): which locks that thread may have left taken."""
    code, globals_, ref = scope
    fn = ctx.sources.function(code)
    if fn is None:
        return []
    me = ref() if ref is not None else None
    names = Scope(None, {"self": me} if me is not None else None, globals_)
    out = []
    for call in fn.calls:
        f = call.func
        if not (isinstance(f, ast.Attribute) and f.attr == "acquire"):
            continue
        obj = source.evaluate(f.value, names)
        kind = sync.kind_of(obj, ctx.known) if obj is not MISSING else None
        row: dict[str, Any] = {"expr": source.expr_text(f.value), "line": call.lineno,
                               "releases_in_code": any(isinstance(c.func, ast.Attribute) and c.func.attr == "release"
                                               and source.expr_text(c.func.value) == source.expr_text(f.value)
                                               for c in fn.calls),
                               "id": objects.hex_id(obj) if kind else None, "kind": kind}
        if kind in ("lock", "rlock"):
            row.update(sync.lock_state(obj))
        out.append(row)
    return out[:32]


def build(forked: dict[str, Any] | None) -> dict[str, Any]:
    """The report, as plain data."""
    cpu0 = time.thread_time()
    wall0 = time.monotonic()
    errors: list[str] = []
    truncated = False

    def over() -> bool:
        return time.thread_time() - cpu0 > CPU_BUDGET

    me = _thread.get_ident()
    current = sys._current_frames()
    active = dict(threading._active)  # type: ignore[attr-defined]  # private: enumerate() would take a lock the program may hold
    limbo = dict(threading._limbo)  # type: ignore[attr-defined]  # private: as above
    live = set(current)
    ctx = waits.Context(sync.Known(), Sources(), live)
    stacks = {ident: waits.stack(frame, waits.MAX_HOLD_FRAMES) for ident, frame in current.items() if ident != me}
    del current
    main_ident = objects.attr(objects.attr(threading, "_main_thread"), "_ident")
    locks = Locks(ctx)
    waited: list[object] = []
    entries = []
    order = sorted(stacks, key=lambda i: (i != main_ident, i))
    for ident in order[:MAX_THREADS]:
        if over():
            truncated = True
            break
        try:
            entries.append(_thread_entry(ident, stacks[ident], active.get(ident) or limbo.get(ident), main_ident, ctx, locks, waited))
        except Exception as exc:  # noqa: BLE001 - a thread we cannot read is an errors line, never a missing report
            errors.append(f"thread {ident}: {type(exc).__name__}")
    report: dict[str, Any] = {
        "version": VERSION, "pid": os.getpid(), "ppid": os.getppid(), "time": time.time(),
        "python": sys.version.split()[0], "implementation": sys.implementation.name,
        "argv": [objects.text(a, 400) for a in sys.argv[:16]] if type(sys.argv) is list else [],
        "threads": entries, "more_threads": max(0, len(order) - MAX_THREADS),
        "fork": forked,
    }
    sections = (("exited_threads", lambda: _exited(ctx)),
                ("asyncio", lambda: loops.describe(stacks, ctx, lambda fs: _task_holds(fs, ctx, locks), over)),
                ("pools", lambda: pools.collect(stacks, waited, ctx)),
                ("children", pools.children),
                ("ended_tasks", lambda: list(tasks_ended.ended)))
    for name, make in sections:
        if over():
            truncated = True
            report.setdefault(name, None)
            continue
        try:
            report[name] = make()
        except Exception as exc:  # noqa: BLE001 - a section that fails is an errors line, never a missing report
            report[name] = None
            errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
    _task_locks(report.get("asyncio") or [], locks)
    found: tuple[list[dict[str, Any]], list[dict[str, Any]]] = report.pop("pools", None) or ([], [])
    report["executors"], report["pools"] = found
    _running_in(entries, report["executors"])
    _rlock_owners(locks, entries)
    report["locks"] = locks.rows
    # Anything left out: threads or frames over their caps, sections past the CPU budget.
    report["truncated"] = truncated or report["more_threads"] > 0 or any(e["more_frames"] for e in entries)
    report["errors"] = errors
    report["cost"] = {"cpu_s": round(time.thread_time() - cpu0, 4), "wall_s": round(time.monotonic() - wall0, 4)}
    return report


def _task_holds(frames: list[types.FrameType], ctx: waits.Context, locks: Locks) -> list[dict[str, Any]]:
    out = []
    for f in frames:
        try:
            for obj, kind, expr, how in waits.frame_holds(f, f.f_lineno, ctx):
                out.append(waits.hold_row(obj, kind, expr, how, f, f.f_lineno))
                locks.row(obj, kind, expr)
        except Exception:  # noqa: BLE001 - a frame we cannot read holds nothing we know of
            continue
    return out


def _running_in(entries: list[dict[str, Any]], executors: list[dict[str, Any]]) -> None:
    """A future some thread waits on, run by a pool's worker: which worker (none: it is still queued)."""
    runs = {}
    for ex in executors:
        for t in ex.get("threads") or []:
            if t.get("running"):
                runs[t["running"].get("future")] = (t.get("ident"), ex.get("id"))
    for e in entries:
        w = e.get("waits") or {}
        if w.get("kind") == "future" and w.get("id"):
            ident, executor = runs.get(w["id"], (None, None))
            w.setdefault("detail", {}).update(running_in=ident, executor=executor)


def _task_locks(loops_: list[dict[str, Any]], locks: Locks) -> None:
    """Tasks as holders and waiters of asyncio locks."""
    for loop in loops_:
        for task in loop.get("tasks") or []:
            aw = task.get("awaits") or {}
            obj = aw.pop("_obj", None)
            if obj is not None and aw.get("kind") in ("lock", "semaphore", "condition"):
                locks.row(obj, "asyncio-" + aw["kind"], aw.get("expr"))["waiter_tasks"].append(task["id"])
            for h in task.get("holds") or []:
                row = locks.rows.get(h["id"])
                if row is not None and task["id"] not in row["holder_tasks"]:
                    row["holder_tasks"].append(task["id"])


def _rlock_owners(locks: Locks, entries: list[dict[str, Any]]) -> None:
    """An RLock says who owns it: that thread holds it, whatever the source says (``how: "owner"``:
    taken through a call the source does not show, such as logging's ``Handler.acquire()``)."""
    by_ident = {e["ident"]: e for e in entries}
    for key, row in locks.rows.items():
        owner = row.get("owner")
        if row.get("kind") != "rlock" or type(owner) is not int or not owner:
            continue
        if owner not in row["holders"]:
            row["holders"].append(owner)
        held_by = by_ident.get(owner)
        if held_by is not None and not any(h["id"] == key for h in held_by["holds"]):
            held_by["holds"].append({"id": key, "expr": row.get("expr"), "kind": "rlock", "where": None, "how": "owner",
                                     "taken_at": None})


def encode(report: dict[str, Any]) -> bytes:
    """JSON within MAX_BYTES: frames cut to 16, then to 4 and threads and tasks to 64, then a stub."""
    for cut in (None, 16, 4):
        if cut is not None:
            _shrink(report, cut)
        data = json.dumps(report, separators=(",", ":"), default=_none).encode()
        if len(data) <= MAX_BYTES:
            return data
    stub = {k: report.get(k) for k in ("version", "pid", "ppid", "time", "python", "cost")}
    stub.update(truncated=True, errors=["the report was over %d bytes" % MAX_BYTES], threads=[], locks={})
    return json.dumps(stub, default=_none).encode()


def _none(_obj: object) -> None:
    return None


def _shrink(report: dict[str, Any], frames: int) -> None:
    report["truncated"] = True
    for t in report.get("threads") or []:
        t["more_frames"] = t.get("more_frames", 0) + max(0, len(t["frames"]) - frames)
        t["frames"] = t["frames"][:frames]
    for loop in report.get("asyncio") or []:
        for task in loop.get("tasks") or []:
            task["frames"] = task["frames"][:frames]
        if frames <= 4:
            loop["tasks"] = loop["tasks"][:64]
    if frames <= 4:
        report["threads"] = report["threads"][:64]
