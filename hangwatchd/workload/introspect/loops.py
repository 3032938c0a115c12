"""asyncio event loops and their tasks: what each task awaits, and a loop held up by a callback.

From outside, a hung asyncio program is one thread in ``select``: every task's
wait is invisible. Here each loop found in a thread's frames (``run_forever``'s
``self``), or named by a task, is listed with its tasks; for each task the
coroutine chain (``cr_await``, innermost first), what it awaits (a future, a
task, an ``asyncio.Lock``, an event, a queue, a sleep), and the locks its
coroutines hold (``async with lock:``, or ``await lock.acquire()`` not yet
released). A loop whose thread is not in ``select`` but inside a callback or a
coroutine step is held up by that frame: ``blocked_by_callback``.

Tasks are read from asyncio's own registry (a WeakSet's underlying set, copied in
one C call), never through ``asyncio.all_tasks()`` (it iterates in Python and
calls each task's ``get_loop()``).
"""

from __future__ import annotations

import ast
import collections
import sys
import types
import weakref
from typing import TYPE_CHECKING, Any, cast

from . import objects, source, sync, waits
from .source import MISSING, Scope

if TYPE_CHECKING:
    import _asyncio

MAX_TASKS = 256
MAX_CHAIN = 64
attr = objects.attr


def all_tasks() -> list[object]:
    at = sys.modules.get("asyncio.tasks")
    if at is None:
        return []
    out: dict[int, object] = {}
    for name in ("_all_tasks", "_scheduled_tasks"):
        data = attr(attr(at, name), "data")
        if type(data) is set:
            for ref in list(data):
                task = ref() if type(ref) is weakref.ref else None
                if task is not None:
                    out[id(task)] = task
    eager = attr(at, "_eager_tasks")
    if type(eager) is set:
        for task in list(eager):
            out[id(task)] = task
    return list(out.values())


def current_task(loop: object) -> object:
    at = sys.modules.get("asyncio.tasks")
    current = attr(at, "_current_tasks") if at is not None else None
    if type(current) is dict:
        for lp, task in list(current.items()):
            if lp is loop:
                return task
    return None


def task_name(task: object) -> str | None:
    c_task = attr(sys.modules.get("_asyncio"), "Task")
    if c_task is not None and objects.is_a(task, c_task):
        # asyncio's C Task class, and a task of it: its own get_name, never one a subclass defines
        c_class = cast("type[_asyncio.Task[Any]]", c_task)
        try:
            return objects.text(c_class.get_name(cast("_asyncio.Task[Any]", task)))
        except Exception:  # noqa: BLE001 - never raise into the reporter: a task with no name is still described
            return None
    return objects.text(attr(task, "_name"))


def chain(coro: object) -> tuple[list[types.FrameType], object]:
    """A coroutine's frames through ``cr_await`` (outermost first), and what the innermost awaits."""
    frames: list[types.FrameType] = []
    obj = coro
    for _ in range(MAX_CHAIN):
        frame: types.FrameType | None
        nxt: object
        if type(obj) is types.CoroutineType:
            frame, nxt = obj.cr_frame, obj.cr_await
        elif type(obj) is types.GeneratorType:
            frame, nxt = obj.gi_frame, obj.gi_yieldfrom
        elif type(obj) is types.AsyncGeneratorType:
            frame, nxt = obj.ag_frame, obj.ag_await
        else:
            return frames, obj
        if frame is not None:
            frames.append(frame)
        if nxt is None:
            return frames, None
        obj = nxt
    return frames, None


def _api(frame: types.FrameType, module: str, ctx: waits.Context) -> tuple[str, object, dict[str, Any]] | None:
    k = ctx.known
    name = frame.f_code.co_name
    me = Scope(frame).lookup("self")
    if module == "asyncio.locks":
        if name == "acquire" and objects.is_a(me, k.a_lock):
            return "lock", me, {}
        if name == "acquire" and objects.is_a(me, k.a_semaphore):
            return "semaphore", me, {}
        if name == "wait" and objects.is_a(me, k.a_event):
            return "event", me, {}
        if name in ("wait", "wait_for") and objects.is_a(me, k.a_condition):
            return "condition", me, {}
    elif module == "asyncio.queues":
        if name in ("get", "put", "join") and objects.is_a(me, k.a_queue):
            return "queue", me, {"op": name}
    elif module == "asyncio.tasks":
        if name == "sleep":
            delay = Scope(frame).lookup("delay")
            return "sleep", None, {"seconds": objects.number(delay)}
    elif module == "asyncio.streams":
        if name in ("read", "readline", "readexactly", "readuntil", "_wait_for_data", "drain"):
            return "io", me, {"op": name}
    return None


def _future_detail(fut: object, ctx: waits.Context) -> dict[str, Any]:
    state = objects.text(attr(fut, "_state"))
    out: dict[str, Any] = {"state": state, "done": state in ("FINISHED", "CANCELLED"), "cancelled": state == "CANCELLED"}
    children = attr(fut, "_children")  # a gather()
    if type(children) is list:
        out["children"] = [{"id": objects.hex_id(c), "name": task_name(c) if ctx.known.is_task(c) else None,
                            "state": objects.text(attr(c, "_state"))} for c in children[:32]]
    callbacks = attr(fut, "_callbacks")
    if type(callbacks) is list:
        fns = [cb[0] if type(cb) is tuple and cb else cb for cb in callbacks[:8]]
        out["callbacks"] = [objects.callable_name(fn) for fn in fns]
        # A task awaiting the future is woken by a callback bound to it: who waits on this future.
        out["awaited_by"] = [objects.hex_id(attr(fn, "__self__")) for fn in fns
                             if type(fn) is types.BuiltinMethodType and ctx.known.is_task(attr(fn, "__self__"))]
    return out


def task_awaits(frames: list[types.FrameType], leaf: object, waiter: object, ctx: waits.Context) -> dict[str, Any] | None:
    """What a task waits on, from its coroutine frames (innermost first) and its ``_fut_waiter``."""
    k = ctx.known
    match = None
    prefix = 0
    for i, f in enumerate(frames):
        module = waits.module_of(f.f_code.co_filename)
        if module is None or not module.startswith("asyncio."):
            break
        prefix = i + 1
        found = _api(f, module, ctx)
        if found is not None:
            match = found
    user = frames[prefix] if prefix < len(frames) else None
    if match is not None:
        kind, obj, detail = match
        if obj is not None and obj is not MISSING:
            detail = dict(sync.detail(obj, sync.kind_of(obj, k), k, ctx.live), **detail)
        known = obj is not None and obj is not MISSING
        out: dict[str, Any] = {"kind": kind, "id": objects.hex_id(obj) if known else None, "detail": detail,
                               "_obj": obj if known else None}
    else:
        target = waiter if waiter is not None else leaf
        if target is None or target is MISSING:
            return None
        if k.is_task(target):
            out = {"kind": "task", "id": objects.hex_id(target),
                   "detail": {"name": task_name(target), "state": objects.text(attr(target, "_state"))}}
        elif k.is_afuture(target):
            out = {"kind": "future", "id": objects.hex_id(target), "detail": _future_detail(target, ctx)}
        else:
            out = {"kind": "other", "id": objects.hex_id(target), "detail": {"type": objects.type_name(target)}}
    out["expr"] = _await_expr(user, ctx, out["kind"]) if user is not None else None
    out["where"] = waits.where(user) if user is not None else None
    return out


def _await_expr(frame: types.FrameType, ctx: waits.Context, kind: str | None) -> str | None:
    """``lock`` of ``await lock.acquire()``, ``q`` of ``await q.get()``; the whole awaited expression
    for the rest (``asyncio.sleep(10)``, ``fut``)."""
    fn = ctx.sources.function(frame.f_code)
    if fn is None:
        return None
    line = frame.f_lineno
    for w in fn.withs:
        if isinstance(w, ast.AsyncWith) and source.in_header(w, line):
            return source.expr_text(w.items[0].context_expr)
    for a in fn.awaits:
        if a.lineno <= line <= (a.end_lineno or a.lineno):
            v = a.value
            if kind in ("lock", "semaphore", "event", "condition", "queue", "io") and isinstance(v, ast.Call) \
                    and isinstance(v.func, ast.Attribute):
                return source.expr_text(v.func.value)
            return source.expr_text(v)
    return None


def describe_task(task: object, ctx: waits.Context, holds_of: Any) -> dict[str, Any]:
    coro = attr(task, "_coro")
    outer_first, leaf = chain(coro)
    frames = list(reversed(outer_first))  # innermost first
    state = objects.text(attr(task, "_state"))
    info = None
    code = coro.cr_code if type(coro) is types.CoroutineType else None
    if code is not None:
        info = {"qualname": objects.qualname(code), "file": objects.text(code.co_filename, 400), "line": code.co_firstlineno}
    return {
        "id": objects.hex_id(task), "name": task_name(task), "coro": info,
        "frames": [waits.where(f) for f in frames[:32]],
        "awaits": task_awaits(frames, leaf, attr(task, "_fut_waiter"), ctx) if state == "PENDING" else None,
        "holds": holds_of(frames),
        "done": state in ("FINISHED", "CANCELLED"), "cancelled": state == "CANCELLED",
        "cancelling": objects.number(attr(task, "_num_cancels_requested")) or (attr(task, "_must_cancel") is True) or 0,
    }


def loops_in(stacks: dict[int, list[types.FrameType]], ctx: waits.Context) -> list[tuple[object, int | None, list[types.FrameType]]]:
    """(loop, thread ident, the frames inside its _run_once) of every loop some thread runs."""
    out: list[tuple[object, int | None, list[types.FrameType]]] = []
    seen: set[int] = set()
    for ident, frames in stacks.items():
        for j, f in enumerate(frames):
            if f.f_code.co_name in ("_run_once", "run_forever") and waits.module_of(f.f_code.co_filename) == "asyncio.base_events":
                loop = Scope(f).lookup("self")
                if ctx.known.is_loop(loop) and id(loop) not in seen:
                    seen.add(id(loop))
                    inner = frames[:j] if f.f_code.co_name == "_run_once" else []
                    out.append((loop, ident, inner))
                break
    return out


def blocked_by(inner: list[types.FrameType], loop: object) -> dict[str, Any] | None:
    """The callback or coroutine step the loop's thread is inside, when it is not in select."""
    if not inner or waits.module_of(inner[-1].f_code.co_filename) == "selectors":
        return None
    own = next((f for f in inner if not waits.is_machinery(waits.module_of(f.f_code.co_filename))), inner[0])
    out = waits.where(own)
    out["frames"] = [waits.where(f) for f in inner[:16]]
    task = current_task(loop)
    out["task"] = task_name(task) if task is not None else None
    return out


def describe(stacks: dict[int, list[types.FrameType]], ctx: waits.Context, holds_of: Any, budget: Any) -> list[dict[str, Any]]:
    """Every loop with its tasks; tasks of loops no thread runs (not running, or a loop in C) under their own loop."""
    found = loops_in(stacks, ctx)
    tasks = all_tasks()
    by_loop: dict[int, list[object]] = {}
    loops: dict[int, tuple[object, int | None, list[types.FrameType]]] = {id(lp): (lp, ident, inner) for lp, ident, inner in found}
    for t in tasks:
        lp = attr(t, "_loop")
        if lp is None:
            continue
        by_loop.setdefault(id(lp), []).append(t)
        if id(lp) not in loops:
            tid = attr(lp, "_thread_id")
            loops[id(lp)] = (lp, tid if type(tid) is int else None, [])
    out = []
    for key, (lp, ident, inner) in loops.items():
        mine = by_loop.get(key, [])
        described = []
        for t in mine[:MAX_TASKS]:
            if budget():
                break
            try:
                described.append(describe_task(t, ctx, holds_of))
            except Exception:  # noqa: BLE001 - one task that cannot be read is left out, the rest are described
                continue
        tid = attr(lp, "_thread_id")
        out.append({"id": objects.hex_id(lp), "type": objects.type_name(lp), "thread": ident,
                    "running": type(tid) is int, "tasks": described, "more_tasks": max(0, len(mine) - MAX_TASKS),
                    "blocked_by_callback": blocked_by(inner, lp), "ready": ready(lp, ctx)})
    return out


def ready(loop: object, ctx: waits.Context) -> list[dict[str, Any]]:
    """The callbacks queued to run next (``call_soon``, ``call_soon_threadsafe``), with the futures
    their closures would complete: what a thread waiting on such a future waits for."""
    queue = attr(loop, "_ready")
    if type(queue) is not collections.deque:
        return []
    out = []
    for handle in list(queue)[:16]:
        cb = attr(handle, "_callback")
        futures = [objects.hex_id(v) for v in objects.closure_values(cb) if objects.is_a(v, ctx.known.future)]
        out.append({"callback": objects.callable_name(cb), "futures": futures})
    return out
