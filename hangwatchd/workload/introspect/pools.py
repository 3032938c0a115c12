"""Thread pools, process pools and child processes: who works for whom, and who is gone.

A ``ThreadPoolExecutor`` whose workers all wait on futures queued behind them
looks, from outside, like N idle-looking threads. Here each executor a thread
works for (its ``_worker`` frame's weak reference) or calls into is listed with
its workers, what each runs (the work item in its frame) and how many items
wait in its queue. A ``multiprocessing.Pool`` is listed with its workers' pids
and exit codes as the pool knows them (attributes only: ``poll()`` would reap
a child), its handler threads (alive in this process or not: a pool used in a
forked child has none), its queued tasks and pending results.

A pool replaces a worker that died and forgets it; so once ``multiprocessing.pool``
is imported, ``Pool._join_exited_workers`` is wrapped to remember the workers it
cleans up (name, pid, exit code), the last ``EXITED_PER_POOL`` of each pool.
"""

from __future__ import annotations

import collections
import sys
import time
import types
import weakref
from typing import Any, cast

from . import objects, sync, waits

attr = objects.attr
EXITED_PER_POOL = 16
MAX_POOLS = 64
exited: dict[int, collections.deque[dict[str, Any]]] = {}  # id(pool._pool) -> workers it cleaned up
_patched = False


def watch_pools() -> None:
    """Called as each thread starts: wraps Pool._join_exited_workers once multiprocessing.pool is in."""
    global _patched
    if _patched:
        return
    mod = sys.modules.get("multiprocessing.pool")
    if mod is None:
        return
    _patched = True
    pool_class = attr(mod, "Pool")
    if type(pool_class) is not type:
        return
    original = type.__dict__["__dict__"].__get__(pool_class).get("_join_exited_workers")
    if type(original) is not staticmethod:
        return
    func = original.__func__

    def _join_exited_workers(pool: list[Any]) -> Any:
        before = list(pool) if type(pool) is list else []
        try:
            return func(pool)
        finally:
            try:
                _note_exits(before, pool)
            except Exception:  # noqa: BLE001 - noting an exit must never break the pool's own cleanup
                pass

    pool_class._join_exited_workers = staticmethod(_join_exited_workers)  # type: ignore[attr-defined]  # Pool's private staticmethod, wrapped on purpose


def _note_exits(before: list[Any], pool: list[Any]) -> None:
    gone = [w for w in before if not any(w is x for x in pool)]
    if not gone:
        return
    ring = exited.get(id(pool))
    if ring is None:
        if len(exited) >= MAX_POOLS:
            exited.pop(next(iter(exited)))
        ring = exited[id(pool)] = collections.deque(maxlen=EXITED_PER_POOL)
    for w in gone:
        row = sync.process_state(w)
        row["ended_by"] = time.time()  # cleaned up by the pool at this time, at most 0.1 s after it exited
        ring.append(row)


def _deref(ref: object) -> object:
    return ref() if type(ref) is weakref.ref else None


def _self(frame: types.FrameType) -> object:
    try:
        return frame.f_locals.get("self")
    except Exception:  # noqa: BLE001 - a frame's locals we cannot read name no pool
        return None


def _qsize(q: object, k: sync.Known) -> int | None:
    return sync.queue_state(q, k).get("qsize") if q is not None else None


def collect(stacks: dict[int, list[types.FrameType]], waited: list[object], ctx: waits.Context) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(executors, pools) that some thread works for, calls into, or waits on."""
    k = ctx.known
    executors: dict[int, object] = {}
    running: dict[int, dict[str, Any]] = {}  # thread ident -> the work item it runs
    pools: dict[int, object] = {}
    for obj in waited:
        if objects.is_a(obj, k.mp_pool):
            pools[id(obj)] = obj
        elif objects.is_a(obj, k.mp_result):
            p = attr(obj, "_pool")
            if objects.is_a(p, k.mp_pool):
                pools[id(p)] = p
    seen_spaces: set[int] = set()
    for frames in stacks.values():
        for obj in _named(frames, seen_spaces):
            if objects.is_a(obj, k.thread_pool) or objects.is_a(obj, k.process_pool):
                executors[id(obj)] = obj
            elif objects.is_a(obj, k.mp_pool):
                pools[id(obj)] = obj
    for ident, frames in stacks.items():
        for f in frames:
            module = waits.module_of(f.f_code.co_filename)
            if module is None or not module.startswith(("concurrent.futures.", "multiprocessing.pool")):
                continue
            name = f.f_code.co_name
            if module == "concurrent.futures.thread" and name == "_worker":
                ex = _deref(f.f_locals.get("executor_reference"))
                if ex is not None:
                    executors[id(ex)] = ex
                continue
            me = _self(f)
            if module == "concurrent.futures.thread" and name == "run" and objects.is_a(me, k.work_item):
                running[ident] = {"fn": objects.callable_info(attr(me, "fn")), "future": objects.hex_id(attr(me, "future"))}
            elif objects.is_a(me, k.thread_pool) or objects.is_a(me, k.process_pool):
                executors[id(me)] = me
            elif objects.is_a(me, k.mp_pool):
                pools[id(me)] = me
    return ([_executor(ex, running, ctx) for ex in executors.values()],
            [_pool(p, ctx) for p in pools.values()])


def _named(frames: list[types.FrameType], seen: set[int]) -> list[object]:
    """What the program's innermost two frames name (their locals, their module's globals): a pool the
    program holds but no thread of this process works for (one inherited through fork)."""
    out: list[object] = []
    own = [f for f in frames if not waits.is_machinery(waits.module_of(f.f_code.co_filename))][:2]
    for f in own:
        try:
            spaces = [f.f_locals, f.f_globals]
        except Exception:  # noqa: BLE001 - a frame's names we cannot read name no pool
            continue
        for space in spaces:
            if id(space) in seen or type(space) is not dict:
                continue
            seen.add(id(space))
            out.extend(list(space.values())[:1024])
    return out


def _executor(ex: object, running: dict[int, dict[str, Any]], ctx: waits.Context) -> dict[str, Any]:
    k = ctx.known
    out: dict[str, Any] = {"id": objects.hex_id(ex), "type": objects.type_name(ex),
                           "max_workers": objects.number(attr(ex, "_max_workers")),
                           "shutdown": attr(ex, "_shutdown_thread") is True or attr(ex, "_shutdown") is True,
                           "broken": objects.text(attr(ex, "_broken")) or (attr(ex, "_broken") is True) or None}
    if objects.is_a(ex, k.thread_pool):
        threads = attr(ex, "_threads")
        rows = []
        for t in (list(threads) if type(threads) is set else [])[:256]:
            row = sync.thread_state(t, ctx.live)
            row["running"] = running.get(row["ident"])
            rows.append(row)
        out.update(threads=rows, queued=_qsize(attr(ex, "_work_queue"), k),
                   name_prefix=objects.text(attr(ex, "_thread_name_prefix")))
    else:
        procs = attr(ex, "_processes")
        pending = attr(ex, "_pending_work_items")
        out.update(processes=[sync.process_state(p) for p in (list(procs.values()) if type(procs) is dict else [])[:256]],
                   pending=len(pending) if type(pending) is dict else None,
                   max_tasks_per_child=objects.number(attr(ex, "_max_tasks_per_child")))
    return out


def _pool(pool: object, ctx: waits.Context) -> dict[str, Any]:
    k = ctx.known
    workers = attr(pool, "_pool")
    cache = attr(pool, "_cache")
    pending = []
    n_pending = None
    if objects.is_a(cache, dict):
        by_job = cast("dict[object, object]", cache)  # a dict (is_a): read through dict's own methods
        n_pending = dict.__len__(by_job)
        for r in list(dict.values(by_job))[:16]:
            pending.append({"job": objects.number(attr(r, "_job")), "left": objects.number(attr(r, "_number_left")),
                            "ready": attr(attr(r, "_event"), "_flag") is True})
    handlers = []
    for name in ("_worker_handler", "_task_handler", "_result_handler"):
        t = attr(pool, name)
        if t is not None:
            row = sync.thread_state(t, ctx.live)
            row["role"] = name[1:]
            handlers.append(row)
    ring = exited.get(id(workers)) if type(workers) is list else None
    return {
        "id": objects.hex_id(pool), "type": objects.type_name(pool), "processes": objects.number(attr(pool, "_processes")),
        "state": objects.text(attr(pool, "_state")),
        "workers": [sync.process_state(w) for w in (list(workers) if type(workers) is list else [])[:256]],
        "exited_workers": list(ring) if ring else [],
        "task_queue": _qsize(attr(pool, "_taskqueue"), k), "pending": n_pending, "results": pending,
        "handlers": handlers,
    }


def children() -> list[dict[str, Any]]:
    """The multiprocessing children this process started and has not cleaned up, as it knows them."""
    kids = attr(sys.modules.get("multiprocessing.process"), "_children")
    if type(kids) is not set:
        return []
    rows = [sync.process_state(p) for p in list(kids)[:256]]
    return sorted(rows, key=lambda r: r.get("pid") or 0)
