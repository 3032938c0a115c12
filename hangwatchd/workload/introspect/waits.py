"""What a thread waits on, and which locks it holds, read from its frames.

The innermost frames say what a thread waits on. Where they are the standard
library's machinery of waiting (``threading``, ``queue``, ``concurrent.futures``,
``multiprocessing``, ``subprocess``, ``selectors``, ``socket``, ``asyncio``), the
outermost such frame names the call the program made (``Event.wait``,
``Queue.get``, ``Thread.join``, ``Pool.map``) and its ``self`` is the object
waited on. Where the innermost frame is the program's own (a C call such as
``lock.acquire()``, ``time.sleep()``, ``os.read()``), the expression on its
current line names it: ``with journal_lock:``, ``self._lock.acquire()``.

A thread holds, in each of its frames, the locks of the ``with`` blocks around
the frame's current line, and those taken by a bare ``EXPR.acquire()`` earlier in
the function with no ``EXPR.release()`` since. The innermost frame's own ``with``
on its current line is what it waits for, not what it holds.
"""

from __future__ import annotations

import _io
import ast
import builtins
import importlib._bootstrap
import io
import os
import select
import threading
import time
import types
import weakref
from typing import Any, cast

from . import objects, source, sync
from .source import MISSING, Scope, Sources

STDLIB = os.path.dirname(threading.__file__)
# Modules whose frames are the machinery of waiting, not the program's own code.
MACHINERY = frozenset({"threading", "queue", "selectors", "subprocess", "socket", "ssl", "socketserver",
                       "http.client", "urllib.request", "ftplib", "smtplib", "imaplib", "poplib",
                       "importlib", "importlib._bootstrap"})
MACHINERY_PACKAGES = ("concurrent.futures.", "multiprocessing.", "asyncio.")
_SLEEP = time.sleep
_MODULE_LOCK = getattr(importlib._bootstrap, "_ModuleLock", None)  # what an import of a module another thread imports waits on
_IO = {id(f): n for n, f in (("read", os.read), ("readv", getattr(os, "readv", None)), ("write", os.write),
                             ("pread", getattr(os, "pread", None))) if f is not None}
_WAITPID = {id(f) for f in (os.waitpid, getattr(os, "wait", None), getattr(os, "wait3", None),
                            getattr(os, "wait4", None), getattr(os, "waitid", None)) if f is not None}
_OPEN = {id(f) for f in (builtins.open, io.open, _io.open, os.open)}
# Files of the io module's own C types: their fileno() runs nothing of the program's.
_FILES = (_io.FileIO, _io.BufferedReader, _io.BufferedWriter, _io.BufferedRandom, _io.BufferedRWPair, _io.TextIOWrapper)
_FILE_OPS = frozenset({"read", "read1", "readline", "readlines", "readinto", "write", "writelines", "flush"})
_SELECT = {id(f) for f in (select.select, getattr(select, "poll", None), getattr(select, "epoll", None)) if f is not None}
_SOCKET_OPS = frozenset({"recv", "recv_into", "recvfrom", "recvfrom_into", "recvmsg", "accept", "connect", "send",
                         "sendall", "sendto", "sendmsg", "_accept"})
MAX_HOLD_FRAMES = 256


OWN = "<hangwatchd introspect>"  # the reporter's own frames (the thread wrapper): machinery too
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def module_of(filename: str) -> str | None:
    """'threading', 'concurrent.futures._base', ... for a frame of the standard library; else None."""
    if filename.startswith(_OWN_DIR):
        return OWN
    if filename.startswith("<frozen ") and filename.endswith(">"):  # the import system's own modules, frozen in
        return filename[len("<frozen "):-1]
    if not filename.startswith(STDLIB + os.sep) or not filename.endswith(".py"):
        return None
    rel = filename[len(STDLIB) + 1:-3]
    if "site-packages" in rel or "dist-packages" in rel:
        return None
    parts = rel.split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_machinery(module: str | None) -> bool:
    return module is not None and (module in MACHINERY or module.startswith(MACHINERY_PACKAGES) or module == OWN)


def where(frame: types.FrameType, line: int | None = None) -> dict[str, Any]:
    code = frame.f_code
    return {"function": objects.qualname(code), "file": objects.text(code.co_filename, 400),
            "line": line if line is not None else frame.f_lineno}


def stack(frame: types.FrameType | None, limit: int) -> list[types.FrameType]:
    """A thread's frames, innermost first, at most ``limit``."""
    out: list[types.FrameType] = []
    while frame is not None and len(out) < limit:
        out.append(frame)
        frame = frame.f_back
    return out


class Context:
    """What one request reads everything against: the types, the sources, the live threads."""

    def __init__(self, known: sync.Known, sources: Sources, live: set[int]) -> None:
        self.known = known
        self.sources = sources
        self.live = live


def _self(frame: types.FrameType) -> object:
    return Scope(frame).lookup("self")


def _local(frame: types.FrameType, name: str) -> object:
    try:
        return frame.f_locals.get(name, MISSING)
    except Exception:  # noqa: BLE001 - locals we cannot read name nothing
        return MISSING


def _api(frame: types.FrameType, module: str, ctx: Context) -> tuple[str, object, dict[str, Any]] | None:
    """(kind, object, detail) when this machinery frame is a call the program makes to wait."""
    k = ctx.known
    name = frame.f_code.co_name
    me = _self(frame)
    if module == "importlib._bootstrap" and name == "acquire" and _MODULE_LOCK is not None and type(me) is _MODULE_LOCK:
        # An import waits for a module another thread is importing: the thread that owns it, by ident.
        owner, mod = objects.attr(me, "owner"), objects.attr(me, "name")
        return "lock", me, {"owner": owner if type(owner) is int else None, "import": objects.text(mod, 200)}
    if module == "threading":
        if name in ("wait", "wait_for") and objects.is_a(me, k.condition):
            return "condition", me, {}
        if name == "__enter__" and objects.is_a(me, k.condition):
            return "condition", me, {"acquiring": True}
        if name == "wait" and objects.is_a(me, k.event):
            return "event", me, {}
        if name == "wait" and objects.is_a(me, k.barrier):
            return "barrier", me, {}
        if name in ("acquire", "__enter__") and objects.is_a(me, k.semaphore):
            return "semaphore", me, {}
        if name in ("join", "_wait_for_tstate_lock") and objects.is_a(me, k.thread):
            return "thread", me, {}
    elif module == "queue":
        if name in ("get", "put", "join") and objects.is_a(me, k.queue):
            return "queue", me, {"op": name}
    elif module == "concurrent.futures._base":
        if name in ("result", "exception") and objects.is_a(me, k.future):
            return "future", me, {}
        if name in ("wait", "as_completed"):
            fs = _local(frame, "fs")
            futures = _futures(fs, k)
            first = next((f for f in futures if f[1].get("state") not in ("FINISHED", "CANCELLED_AND_NOTIFIED")), None)
            return "future", (first[0] if first else None), {"futures": [dict(d, id=objects.hex_id(f)) for f, d in futures]}
    elif module == "concurrent.futures.thread":
        if name == "_worker":
            ref = _local(frame, "executor_reference")
            executor = _deref(ref)
            return "queue", _local(frame, "work_queue"), {"idle_worker": True, "executor": objects.hex_id(executor) if executor is not None else None}
    elif module == "multiprocessing.pool":
        if objects.is_a(me, k.mp_pool) and not name.startswith("_handle"):
            return "process", me, {"via": "pool", "op": name, "func": objects.callable_info(_local(frame, "func"))
                                   if _local(frame, "func") is not MISSING else None}
        if objects.is_a(me, k.mp_result) or name == "next" and objects.attr(me, "_cond") is not None:
            return "process", me, {"via": "pool", "op": name}
        if name == "worker":
            return "queue", _local(frame, "inqueue"), {"idle_pool_worker": True}
        if name == "_handle_tasks":
            return "queue", _local(frame, "taskqueue"), {"pool_handler": True}
    elif module == "multiprocessing.process":
        if name == "join" and objects.is_a(me, k.mp_process):
            return "process", me, {}
    elif module.startswith("multiprocessing.popen"):
        if name in ("wait", "poll", "_wait"):
            return "process", me, {}
    elif module == "multiprocessing.queues":
        if name in ("get", "put", "join"):
            return "process", me, {"via": "queue", "op": name}
    elif module == "multiprocessing.connection":
        if name in ("recv", "recv_bytes", "recv_bytes_into", "poll", "wait"):
            return "process", (me if me is not MISSING else None), {"via": "pipe", "op": name}
    elif module == "multiprocessing.synchronize":
        if name == "wait" and objects.is_a(me, k.mp_event):
            return "event", me, {"multiprocessing": True}
        if name in ("wait", "wait_for") and objects.is_a(me, k.mp_condition):
            return "condition", me, {"multiprocessing": True}
        if name in ("__enter__", "acquire") and objects.is_a(me, k.mp_semlock):
            return "mp-lock", me, {}
    elif module == "subprocess":
        if name in ("wait", "_wait", "communicate", "_communicate", "_try_wait") and objects.is_a(me, k.popen):
            return "process", me, {"op": name}
    elif module == "selectors":
        if name == "select":
            return "select", me, {}
    elif module in ("socket", "ssl"):
        if name in ("accept", "readinto", "recv", "recv_into", "read", "do_handshake", "create_connection", "connect"):
            return "io", (me if objects.is_a(me, k.socket) else None), {"op": name}
    elif module == "socketserver":
        if name in ("serve_forever", "handle_request"):
            return "select", me, {"server": True}
    elif module == "asyncio.base_events":
        if name in ("run_forever", "_run_once", "run_until_complete") and k.is_loop(me):
            return "asyncio-loop", me, {}
    return None


def _deref(ref: object) -> object:
    if type(ref) is weakref.ref:  # calling a weak reference runs nothing of the program's
        return ref()
    return None


def _futures(fs: object, k: sync.Known) -> list[tuple[object, dict[str, Any]]]:
    if not (type(fs) is set or type(fs) is frozenset or type(fs) is list or type(fs) is tuple):
        return []
    out = []
    for f in list(fs)[:16]:
        if objects.is_a(f, k.future):
            out.append((f, {"state": objects.text(objects.attr(f, "_state"))}))
    return out


def thread_wait(frames: list[types.FrameType], ctx: Context) -> dict[str, Any] | None:
    """What the innermost frames of a thread wait on (frames innermost first). ``_obj`` is the object
    itself, for the caller to take out before the report is written."""
    if not frames:
        return None
    match = None
    prefix = 0
    for i, f in enumerate(frames):
        module = module_of(f.f_code.co_filename)
        if module is None or not is_machinery(module):
            break
        prefix = i + 1
        found = _api(f, module, ctx)
        if found is not None:
            match = (i, found)
    if match is not None:
        i, (kind, obj, extra) = match
        out = _wait(kind, obj, extra, ctx)
        if prefix < len(frames):  # the program's frame that called into the machinery
            out["where"] = where(frames[prefix])
            out["expr"] = _expr_at(frames[prefix], frames[i].f_code.co_name, ctx) if kind != "asyncio-loop" else None
        else:  # machinery all the way down (an idle pool worker, Thread(target=event.wait))
            out["where"] = where(frames[i])
            out["expr"] = None
        out["api"] = objects.qualname(frames[i].f_code)
        return out
    return _own_wait(frames[0], ctx)


def _wait(kind: str | None, obj: object, extra: dict[str, Any], ctx: Context) -> dict[str, Any]:
    detail: dict[str, Any] = {}
    if obj is not None and obj is not MISSING:
        detail = sync.detail(obj, sync.kind_of(obj, ctx.known), ctx.known, ctx.live)
    detail.update(extra)
    known = obj is not None and obj is not MISSING
    return {"kind": kind, "id": objects.hex_id(obj) if known else None, "type": objects.type_name(obj) if known else None,
            "detail": detail, "_obj": obj if known else None}


def _expr_at(frame: types.FrameType, api: str, ctx: Context) -> str | None:
    """The expression the program's frame waits through: ``ready`` of ``ready.wait()``."""
    fn = ctx.sources.function(frame.f_code)
    if fn is None:
        return None
    line = frame.f_lineno
    for w in fn.withs:
        if source.in_header(w, line) and api == "__enter__":
            return source.expr_text(w.items[0].context_expr)
    calls = source.calls_at(fn, line, source.position(frame))
    for call in calls:
        f = call.func
        if isinstance(f, ast.Attribute) and f.attr == api:
            return source.expr_text(f.value)
    for w in fn.withs:
        if source.in_header(w, line):
            return source.expr_text(w.items[0].context_expr)
    if calls:
        f = calls[0].func
        return source.expr_text(f.value if isinstance(f, ast.Attribute) else calls[0])
    return None


def _own_wait(frame: types.FrameType, ctx: Context) -> dict[str, Any]:
    """The program's own frame is innermost: the C call on its current line says what it waits on."""
    out: dict[str, Any] = {"kind": None, "id": None, "type": None, "expr": None, "detail": {}, "where": where(frame)}
    text = ctx.sources.line(frame.f_code.co_filename, frame.f_lineno)
    if text is not None:  # what the line says, where nothing more is known
        out["expr"] = objects.text(text.strip())
    fn = ctx.sources.function(frame.f_code)
    if fn is None:
        return out
    line = frame.f_lineno
    scope = Scope(frame)
    k = ctx.known
    for w in fn.withs:
        if not source.in_header(w, line):
            continue
        for item in w.items:
            obj = source.evaluate(item.context_expr, scope)
            kind = sync.kind_of(obj, k) if obj is not MISSING else None
            if kind in sync.LOCK_KINDS and _takes(obj, kind):
                out.update(_wait(kind, obj, {}, ctx))
                out["expr"] = source.expr_text(item.context_expr)
                return out
    calls = source.calls_at(fn, line, source.position(frame))
    for call in calls:
        found = _call_wait(call, scope, ctx)
        if found is not None:
            found["where"] = out["where"]
            return found
    if calls:
        out["expr"] = source.expr_text(calls[0])
    return out


def _takes(obj: object, kind: str | None) -> bool:
    """A lock someone holds (or that cannot say): what a thread on the line of its ``with`` waits for."""
    if kind in ("lock", "rlock"):
        return sync.lock_state(obj).get("locked") is not False
    return True


def _call_wait(call: ast.Call, scope: Scope, ctx: Context) -> dict[str, Any] | None:
    f = call.func
    k = ctx.known
    if isinstance(f, ast.Attribute):
        obj = source.evaluate(f.value, scope)
        if obj is not MISSING:
            kind = sync.kind_of(obj, k)
            m = f.attr
            hit = ((kind in sync.LOCK_KINDS and m in ("acquire", "__enter__")) or (kind == "queue" and m in ("get", "put"))
                   or (kind == "socket" and m in _SOCKET_OPS))
            if hit:
                out = _wait("io" if kind == "socket" else kind, obj, {"op": m} if kind in ("queue", "socket") else {}, ctx)
                out["expr"] = source.expr_text(f.value)
                return out
            if m in _FILE_OPS and any(type(obj) is t for t in _FILES):
                io_obj = cast("_io._IOBase", obj)  # exactly one of the io module's own _FILES (above)
                try:
                    fd = type(io_obj).fileno(io_obj)
                except (OSError, ValueError):
                    fd = None
                return {"kind": "io", "id": objects.hex_id(obj), "type": objects.type_name(obj), "expr": source.expr_text(f.value),
                        "detail": {"op": m, "fd": fd}}
    fobj = source.evaluate(f, scope)
    if fobj is MISSING:
        return None
    if fobj is _SLEEP:
        seconds = source.constant(call.args[0], scope) if call.args else MISSING
        return {"kind": "sleep", "id": None, "type": None, "expr": source.expr_text(call),
                "detail": {"seconds": objects.number(seconds) if seconds is not MISSING else None}}
    if id(fobj) in _IO:
        fd_value = source.constant(call.args[0], scope) if call.args else MISSING
        return {"kind": "io", "id": None, "type": None, "expr": source.expr_text(call),
                "detail": {"op": _IO[id(fobj)], "fd": objects.number(fd_value) if fd_value is not MISSING else None}}
    if id(fobj) in _WAITPID:
        pid = source.constant(call.args[0], scope) if call.args else MISSING
        return {"kind": "process", "id": None, "type": None, "expr": source.expr_text(call),
                "detail": {"op": "waitpid", "pid": objects.number(pid) if pid is not MISSING else None}}
    if id(fobj) in _OPEN:
        path = source.constant(call.args[0], scope) if call.args else MISSING
        return {"kind": "io", "id": None, "type": None, "expr": source.expr_text(call),
                "detail": {"op": "open", "path": objects.text(path, 400) if path is not MISSING else None}}
    if id(fobj) in _SELECT:
        return {"kind": "select", "id": None, "type": None, "expr": source.expr_text(call), "detail": {}}
    return None


def frame_holds(frame: types.FrameType, line: int, ctx: Context, unwound: bool = False) -> list[tuple[object, str, str, dict[str, Any]]]:
    """(lock, kind, expr, how) of every lock-like object this frame holds at ``line``.

    ``unwound``: the frame of a traceback, which an exception left: its ``with`` blocks have
    released what they took, and so have ``finally`` blocks; only bare acquires remain."""
    module = module_of(frame.f_code.co_filename)
    if is_machinery(module):
        return []
    fn = ctx.sources.function(frame.f_code)
    if fn is None:
        return []
    scope = Scope(frame)
    out = []
    if not unwound:
        for w in fn.withs:
            if not source.body_holds(w, line):
                continue
            for item in w.items:
                obj = source.evaluate(item.context_expr, scope)
                kind = sync.kind_of(obj, ctx.known) if obj is not MISSING else None
                if kind in sync.LOCK_KINDS:
                    out.append((obj, kind, source.expr_text(item.context_expr),
                                {"how": "async with" if isinstance(w, ast.AsyncWith) else "with", "taken_at": w.lineno}))
    for expr, at in source.open_acquires(fn, line, unwound):
        obj = source.evaluate(expr, scope)
        kind = sync.kind_of(obj, ctx.known) if obj is not MISSING else None
        if kind in sync.LOCK_KINDS:
            out.append((obj, kind, source.expr_text(expr), {"how": "acquire", "taken_at": at}))
    return out


def hold_row(obj: object, kind: str, expr: str, how: dict[str, Any], frame: types.FrameType, line: int) -> dict[str, Any]:
    return dict({"id": objects.hex_id(obj), "expr": expr, "kind": kind, "where": where(frame, line)}, **how)


def traceback_holds(raw: list[tuple[types.FrameType, int]]) -> list[dict[str, Any]]:
    """The locks the frames of an exception's traceback (innermost first) still held as it left them."""
    ctx = Context(sync.Known(), Sources(), set())
    out = []
    for frame, line in raw[:MAX_HOLD_FRAMES]:
        for obj, kind, expr, how in frame_holds(frame, line, ctx, unwound=True):
            row = hold_row(obj, kind, expr, how, frame, line)
            row.update(sync.lock_state(obj) if kind in ("lock", "rlock") else {})
            out.append(row)
    return out
