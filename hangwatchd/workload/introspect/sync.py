"""What a synchronisation object is, and its state, read without taking it.

Locks, conditions, events, semaphores, barriers, queues and futures of the
standard library (threading, queue, concurrent.futures, asyncio,
multiprocessing), as this program has imported them: a module the program never
imported is never imported here (an import takes the import lock, which a hung
import may hold). ``Lock.locked()`` and the C ``RLock``'s repr (which prints its
owner and count) are C calls that take nothing; ``Queue.qsize()`` takes the
queue's mutex, so a queue's size is the length of its deque instead.
"""

from __future__ import annotations

import _thread
import collections
import sys
from typing import Any

from . import objects

attr = objects.attr
LOCK = type(_thread.allocate_lock())
RLOCK = getattr(_thread, "RLock", None)  # the C RLock


def _module(name: str) -> object:
    return sys.modules.get(name)


def _get(module: object, name: str) -> Any:
    return attr(module, name) if module is not None else None  # never a module's __getattr__ (lazy imports)


class Known:
    """The types to recognise, from the modules the program has imported, looked up once a request."""

    def __init__(self) -> None:
        th = _module("threading")
        self.py_rlock = _get(th, "_PyRLock")
        self.condition = _get(th, "Condition")
        self.semaphore = _get(th, "Semaphore")
        self.bounded_semaphore = _get(th, "BoundedSemaphore")
        self.event = _get(th, "Event")
        self.barrier = _get(th, "Barrier")
        self.thread = _get(th, "Thread")
        q = _module("queue")
        self.queue = _get(q, "Queue")
        self.simple_queue = _get(_module("_queue"), "SimpleQueue")
        self.future = _get(_module("concurrent.futures._base"), "Future")
        cft = _module("concurrent.futures.thread")
        self.thread_pool = _get(cft, "ThreadPoolExecutor")
        self.work_item = _get(cft, "_WorkItem")
        self.process_pool = _get(_module("concurrent.futures.process"), "ProcessPoolExecutor")
        al = _module("asyncio.locks")
        self.a_lock = _get(al, "Lock")
        self.a_event = _get(al, "Event")
        self.a_condition = _get(al, "Condition")
        self.a_semaphore = _get(al, "Semaphore")
        self.a_queue = _get(_module("asyncio.queues"), "Queue")
        af = _module("asyncio.futures")
        at = _module("asyncio.tasks")
        ca = _module("_asyncio")
        self.a_futures = tuple(x for x in (_get(af, "_PyFuture"), _get(ca, "Future"), _get(af, "Future")) if x is not None)
        self.a_tasks = tuple(x for x in (_get(at, "_PyTask"), _get(ca, "Task"), _get(at, "Task")) if x is not None)
        self.event_loop = _get(_module("asyncio.base_events"), "BaseEventLoop")
        self.abstract_loop = _get(_module("asyncio.events"), "AbstractEventLoop")
        mpp = _module("multiprocessing.pool")
        self.mp_pool = _get(mpp, "Pool")
        self.mp_result = _get(mpp, "ApplyResult")
        self.mp_process = _get(_module("multiprocessing.process"), "BaseProcess")
        mpq = _module("multiprocessing.queues")
        self.mp_queue = _get(mpq, "Queue")
        self.mp_simple_queue = _get(mpq, "SimpleQueue")
        self.mp_connection = _get(_module("multiprocessing.connection"), "_ConnectionBase")
        mps = _module("multiprocessing.synchronize")
        self.mp_semlock = _get(mps, "SemLock")
        self.mp_event = _get(mps, "Event")
        self.mp_condition = _get(mps, "Condition")
        self.popen = _get(_module("subprocess"), "Popen")
        self.socket = _get(_module("_socket"), "socket")

    def is_loop(self, obj: object) -> bool:
        return objects.is_a(obj, self.event_loop) or objects.is_a(obj, self.abstract_loop)

    def is_task(self, obj: object) -> bool:
        return any(objects.is_a(obj, t) for t in self.a_tasks)

    def is_afuture(self, obj: object) -> bool:
        return any(objects.is_a(obj, t) for t in self.a_futures)


# What a thread can hold: a lock, or something that holds one (a condition, a semaphore).
LOCK_KINDS = frozenset({"lock", "rlock", "condition", "semaphore", "asyncio-lock", "asyncio-condition",
                        "asyncio-semaphore", "mp-lock"})


def kind_of(obj: object, k: Known) -> str | None:
    """The kind of a synchronisation object, or None for anything else."""
    tp = type(obj)
    if tp is LOCK:
        return "lock"
    if RLOCK is not None and objects.is_a(obj, RLOCK) or objects.is_a(obj, k.py_rlock):
        return "rlock"
    for cls, kind in ((k.condition, "condition"), (k.semaphore, "semaphore"), (k.event, "event"),
                      (k.barrier, "barrier"), (k.queue, "queue"), (k.simple_queue, "queue"), (k.future, "future"),
                      (k.thread, "thread"), (k.a_lock, "asyncio-lock"), (k.a_event, "asyncio-event"),
                      (k.a_condition, "asyncio-condition"), (k.a_semaphore, "asyncio-semaphore"),
                      (k.a_queue, "asyncio-queue"), (k.mp_semlock, "mp-lock"), (k.mp_event, "event"),
                      (k.mp_condition, "condition"), (k.mp_queue, "queue"), (k.mp_simple_queue, "queue"),
                      (k.mp_process, "process"), (k.popen, "process"), (k.mp_result, "future"),
                      (k.mp_connection, "pipe"), (k.socket, "socket")):
        if objects.is_a(obj, cls):
            return kind
    if k.is_task(obj):
        return "task"
    if k.is_afuture(obj):
        return "asyncio-future"
    return None


def rlock_state(obj: object) -> dict[str, Any]:
    """{locked, owner, count} of an RLock: the C one says them in its repr, the Python one in attributes."""
    if RLOCK is not None and objects.is_a(obj, RLOCK):
        try:
            r = RLOCK.__repr__(obj)  # C: "<locked _thread.RLock object owner=140.. count=1 at 0x..>"
        except Exception:  # noqa: BLE001 - a lock whose state we cannot read says nothing of it
            return {}
        out: dict[str, Any] = {"locked": r.startswith("<locked")}
        for word in r.split():
            key, _, value = word.partition("=")
            if key in ("owner", "count") and value.isdigit():
                out[key] = int(value)
        return out
    owner = attr(obj, "_owner")
    count = attr(obj, "_count")
    return {"locked": owner is not None, "owner": owner if type(owner) is int else None,
            "count": count if type(count) is int else None}


def lock_state(obj: object) -> dict[str, Any]:
    if type(obj) is LOCK:
        try:
            return {"locked": bool(LOCK.locked(obj))}
        except Exception:  # noqa: BLE001 - a lock whose state we cannot read says nothing of it
            return {}
    return rlock_state(obj)


def _length(obj: object) -> int | None:
    """len() of a deque, list, dict or set (exactly those C types: nothing of the program's runs)."""
    if type(obj) is collections.deque or type(obj) is list or type(obj) is dict or type(obj) is set:
        return len(obj)
    return None


def detail(obj: object, kind: str | None, k: Known, live: set[int]) -> dict[str, Any]:
    """The facts of a synchronisation object that say who could wake its waiters."""
    try:
        return _detail(obj, kind, k, live)
    except Exception:  # noqa: BLE001 - a fact we could not read is a fact left out
        return {}


def _detail(obj: object, kind: str | None, k: Known, live: set[int]) -> dict[str, Any]:
    if kind in ("lock", "rlock"):
        return lock_state(obj)
    if kind == "condition":
        lock = attr(obj, "_lock")
        inner = kind_of(lock, k)
        out = {"lock": objects.hex_id(lock), "lock_kind": inner, "waiting": _length(attr(obj, "_waiters"))}
        out.update(lock_state(lock) if inner in ("lock", "rlock") else {})
        return out
    if kind == "semaphore":
        return {"value": objects.number(attr(obj, "_value")), "bounded": objects.is_a(obj, k.bounded_semaphore)}
    if kind == "event":
        if objects.is_a(obj, k.mp_event):
            return {"multiprocessing": True}
        return {"is_set": attr(obj, "_flag") is True}
    if kind == "barrier":
        return {"parties": objects.number(attr(obj, "_parties")), "waiting": objects.number(attr(obj, "_count")),
                "state": objects.number(attr(obj, "_state"))}
    if kind == "queue":
        return queue_state(obj, k)
    if kind == "future":
        if objects.is_a(obj, k.mp_result):
            ev = attr(obj, "_event")
            return {"state": "FINISHED" if attr(ev, "_flag") is True else "PENDING", "job": objects.number(attr(obj, "_job")),
                    "left": objects.number(attr(obj, "_number_left")), "pool": objects.hex_id(attr(obj, "_pool"))}
        return future_state(obj, k)
    if kind == "thread":
        return thread_state(obj, live)
    if kind == "process":
        return process_state(obj)
    if kind == "asyncio-lock":
        return {"locked": attr(obj, "_locked") is True, "waiting": _length(attr(obj, "_waiters")) or 0}
    if kind == "asyncio-event":
        return {"is_set": attr(obj, "_value") is True}
    if kind == "asyncio-condition":
        lock = attr(obj, "_lock")
        return {"lock": objects.hex_id(lock), "locked": attr(lock, "_locked") is True}
    if kind == "asyncio-semaphore":
        return {"value": objects.number(attr(obj, "_value"))}
    if kind == "asyncio-queue":
        return {"qsize": _length(attr(obj, "_queue")), "maxsize": objects.number(attr(obj, "_maxsize")),
                "unfinished_tasks": objects.number(attr(obj, "_unfinished_tasks"))}
    if kind == "pipe":
        return {"fd": objects.number(attr(obj, "_handle"))}
    if kind == "socket" and k.socket is not None:
        try:
            return {"fd": k.socket.fileno(obj)}
        except Exception:  # noqa: BLE001 - a closed or foreign socket has no descriptor to name
            return {}
    return {}


def future_state(fut: object, k: Known) -> dict[str, Any]:
    """A concurrent.futures.Future: its state, and who will complete it where that shows in its
    callbacks (run_coroutine_threadsafe's: the event loop, and so the thread, that must run)."""
    out: dict[str, Any] = {"state": objects.text(attr(fut, "_state")), "waiting": _length(attr(fut, "_waiters"))}
    callbacks = attr(fut, "_done_callbacks")
    if type(callbacks) is list and callbacks:
        out["callbacks"] = [objects.callable_name(cb) for cb in callbacks[:8]]
        for cb in callbacks[:8]:
            for v in objects.closure_values(cb):
                if k.is_loop(v):
                    tid = attr(v, "_thread_id")
                    out["loop"] = objects.hex_id(v)
                    out["loop_thread"] = tid if type(tid) is int else None
                elif k.is_task(v):
                    out["task"] = objects.hex_id(v)
    return out


def queue_state(obj: object, k: Known) -> dict[str, Any]:
    if objects.is_a(obj, k.simple_queue):
        try:
            return {"qsize": k.simple_queue.qsize(obj), "type": "SimpleQueue"}
        except Exception:  # noqa: BLE001 - a queue whose size we cannot read still says its type
            return {"type": "SimpleQueue"}
    if objects.is_a(obj, k.mp_queue) or objects.is_a(obj, k.mp_simple_queue):
        feeder = attr(obj, "_thread")
        return {"multiprocessing": True, "maxsize": objects.number(attr(obj, "_maxsize")),
                "buffered": _length(attr(obj, "_buffer")), "feeder": objects.hex_id(feeder) if feeder is not None else None,
                "reader_fd": objects.number(attr(attr(obj, "_reader"), "_handle"))}
    return {"qsize": _length(attr(obj, "queue")), "unfinished_tasks": objects.number(attr(obj, "unfinished_tasks")),
            "maxsize": objects.number(attr(obj, "maxsize")), "type": objects.type_name(obj)}


def thread_state(obj: object, live: set[int]) -> dict[str, Any]:
    ident = attr(obj, "_ident")
    return {"ident": ident if type(ident) is int else None, "name": objects.text(attr(obj, "_name")),
            "alive": type(ident) is int and ident in live and attr(obj, "_is_stopped") is not True,
            "daemon": attr(obj, "_daemonic") is True}


def process_state(obj: object) -> dict[str, Any]:
    """pid and exit code as the object last saw them: never poll(), which reaps the child."""
    popen = attr(obj, "_popen")
    if popen is not None:  # a multiprocessing Process, and the function it runs (its target, else its run)
        target = attr(obj, "_target")
        return {"pid": objects.number(attr(popen, "pid")), "exitcode": objects.number(attr(popen, "returncode")),
                "name": objects.text(attr(obj, "_name")), "parent_pid": objects.number(attr(obj, "_parent_pid")),
                "target": objects.callable_name(target) if target is not None else None}
    return {"pid": objects.number(attr(obj, "pid")), "exitcode": objects.number(attr(obj, "returncode")),
            "name": objects.text(attr(obj, "_name"))}
