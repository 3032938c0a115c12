"""Threads as the program knows them, and the ones that are gone.

A thread that took a lock and returned (or raised) leaves no trace a debugger
can see from outside: the lock stays locked, and nobody alive holds it. So from
install on, every ``threading.Thread`` is recorded as it ends, in a ring of the
last ``RING`` endings: its name, ident, target (with the names its code uses, so
an analyser can tell which ended thread used a lock's name), when it started and
ended, and the exception that ended it (with the frames it went through and the
locks those frames held). ``Thread._bootstrap_inner`` is wrapped for this, once;
the thread's own exception hook is wrapped per thread, so a ``threading.excepthook``
the program sets later still runs, and still lets us see the exception.

After ``fork()`` only the forking thread exists in the child: the others are
recorded as ended by the fork (``how: "lost_at_fork"``), since a lock one of them
held is held by nobody in the child.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import types
import weakref
from typing import Any, Callable, cast

from . import graph_replays, objects, pools, waits

RING = 64
ended: collections.deque[dict[str, Any]] = collections.deque(maxlen=RING)
started_at: dict[int, float] = {}  # ident -> time.time() the thread began, for threads started since install
_at_fork: list[tuple[int, object, object, float | None]] = []  # (ident, Thread, target, started), taken before fork
_original_bootstrap: Any = None


def target_info(thread: object, target: object = objects.MISSING) -> dict[str, object] | None:
    """The code a thread runs: its target, else its class's own ``run``."""
    if target is objects.MISSING:
        target = objects.attr(thread, "_target")
    if target is not None:
        return objects.callable_info(target)
    run = None
    for klass in objects.mro(thread):
        d = type.__dict__["__dict__"].__get__(klass)
        if "run" in d:
            run = d["run"]
            break
    return objects.callable_info(run) if type(run) is types.FunctionType and run is not threading.Thread.run else None


def code_scope(thread: object, target: object) -> tuple[types.CodeType, dict[str, object], weakref.ref[object] | None] | None:
    """(code, its globals, a weak reference to its self) of what a thread ran: enough to evaluate, later,
    the expressions its code acquires (``journal_lock``, ``self._lock``) without keeping the thread's objects."""
    fn = target if target is not objects.MISSING else None
    if fn is None:
        for klass in objects.mro(thread):
            d = type.__dict__["__dict__"].__get__(klass)
            if "run" in d:
                fn = d["run"]
                break
        bound: object = thread
    else:
        bound = fn.__self__ if type(fn) is types.MethodType else None
        fn = fn.__func__ if type(fn) is types.MethodType else fn
    if type(fn) is not types.FunctionType:
        return None
    try:
        ref = weakref.ref(bound) if bound is not None else None
    except TypeError:
        ref = None
    return fn.__code__, fn.__globals__, ref


def install() -> None:
    """Wrap ``Thread._bootstrap_inner`` once, for the rest of this process (forks included)."""
    global _original_bootstrap
    if _original_bootstrap is not None:
        return
    _original_bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]  # private, and wrapped on purpose
    threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]  # private, and wrapped on purpose


def _bootstrap_inner(self: threading.Thread) -> None:
    """Every thread's start and end (its one extra frame in a stack, under ``Thread._bootstrap_inner``)."""
    began = time.time()
    target = objects.MISSING
    note: dict[str, Any] = {}
    try:
        target = objects.attr(self, "_target")
        started_at[threading.get_ident()] = began
        # the function Thread.__init__ made for this thread (threading._make_invoke_excepthook)
        invoke = cast("Callable[[threading.Thread], None] | None", (objects.instance_dict(self) or {}).get("_invoke_excepthook"))
        if invoke is not None:
            def _invoke_excepthook(thread: threading.Thread) -> None:
                _note_exception(note)
                invoke(thread)
                graph_replays.tell(sys.exc_info()[1])

            self._invoke_excepthook = _invoke_excepthook  # type: ignore[attr-defined]  # private, and wrapped on purpose
        pools.watch_pools()
    except Exception:  # noqa: BLE001 - recording must never keep a thread from running
        pass
    try:
        _original_bootstrap(self)
    finally:
        try:
            _record_end(self, target, began, note)
        except Exception:  # noqa: BLE001 - recording must never keep a thread from ending
            pass


def _note_exception(note: dict[str, Any]) -> None:
    """In the dying thread, from its exception hook: what raised, where, and which locks its frames held."""
    try:
        exc_type, exc, tb = sys.exc_info()
        if exc_type is None:
            return
        try:
            message = str(exc)  # in the dying thread, as the default hook would print it
        except Exception:  # noqa: BLE001 - an exception whose str() fails is still recorded
            message = "?"
        frames = []
        raw: list[tuple[types.FrameType, int]] = []
        while tb is not None and len(raw) < 256:
            raw.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        for frame, line in reversed(raw[-64:]):  # innermost first
            code = frame.f_code
            frames.append({"function": objects.qualname(code), "file": objects.text(code.co_filename, 400), "line": line})
        holds = waits.traceback_holds(list(reversed(raw)))
        note["exception"] = {"type": objects.type_name(exc), "message": message[:500], "frames": frames, "holds": holds}
    except Exception:  # noqa: BLE001 - the exception hook must never raise in the dying thread
        pass


def _record_end(thread: threading.Thread, target: object, began: float, note: dict[str, Any]) -> None:
    d = objects.instance_dict(thread) or {}
    ident = d.get("_ident")
    if type(ident) is int:  # what threading.get_ident() gave it; None for a thread that never ran
        started_at.pop(ident, None)
    exc = note.get("exception")
    ended.append({
        "name": objects.text(d.get("_name")), "ident": ident, "native_id": d.get("_native_id"),
        "daemon": d.get("_daemonic") is True, "target": target_info(thread, target), "started": began,
        "ended": time.time(), "how": "raised" if exc else "returned", "exception": exc, "_code": code_scope(thread, target),
    })


def before_fork() -> None:
    """In the forking thread, just before fork(): who runs now, to say in the child who was lost."""
    try:
        me = threading.get_ident()
        _at_fork[:] = [(ident, t, objects.attr(t, "_target"), started_at.get(ident))
                       for ident, t in list(threading._active.items()) if ident != me]  # type: ignore[attr-defined]  # private: one C copy, no lock
    except Exception:  # noqa: BLE001 - fork must go on: the child only says less of who was lost
        _at_fork[:] = []


def after_fork_in_child() -> None:
    """The threads that ran in the parent at fork are gone here: recorded as ended by the fork."""
    now = time.time()
    lost = list(_at_fork)
    _at_fork[:] = []
    started_at.clear()
    for ident, thread, target, began in lost:
        d = objects.instance_dict(thread) or {}
        ended.append({
            "name": objects.text(d.get("_name")), "ident": ident, "native_id": d.get("_native_id"),
            "daemon": d.get("_daemonic") is True, "target": target_info(thread, target), "started": began,
            "ended": now, "how": "lost_at_fork", "exception": None, "_code": code_scope(thread, target),
        })


def after_fork_in_parent() -> None:
    _at_fork[:] = []
