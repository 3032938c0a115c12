"""asyncio tasks as they end: a ring of the last ``RING``, for "the task that was to put into the queue
raised" and "the task that held the lock was cancelled".

A task that ends is gone from asyncio's registry; the report can only say what
ended if it was written down then. ``asyncio.base_events.BaseEventLoop.create_task``
(what ``asyncio.create_task`` and ``asyncio.run`` call) is wrapped to give each new
task one done-callback that notes how it ended: returned, raised (its exception's
type and message, read from the task without retrieving it, so asyncio's own
"exception was never retrieved" still speaks), or cancelled; and the names its
coroutine's code uses, so the analyser can tell which ended task used a queue's or
a lock's name. asyncio is never imported for this: the wrap waits for the program
to import it (``imports.when_imported``).
"""

from __future__ import annotations

import collections
import time
import types
from typing import Any

from . import imports, objects

RING = 64
ended: collections.deque[dict[str, Any]] = collections.deque(maxlen=RING)
_MODULE = "asyncio.base_events"
_done = False


def install() -> None:
    """Wrap now if asyncio is loaded, else when it is."""
    imports.when_imported(_MODULE, _wrap)


def _wrap(module: types.ModuleType) -> None:
    global _done
    if _done:
        return
    _done = True
    base = getattr(module, "BaseEventLoop", None)
    original = getattr(base, "create_task", None)
    if base is None or original is None:
        return

    def create_task(self: object, coro: object, *args: Any, **kwargs: Any) -> object:
        task = original(self, coro, *args, **kwargs)
        try:
            task.add_done_callback(_note)
        except Exception:  # noqa: BLE001 - a task this cannot follow is only less explained
            pass
        return task

    base.create_task = create_task


def _note(task: Any) -> None:
    try:
        coro = task.get_coro()
        code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
        cancelled = task.cancelled()
        exc = None if cancelled else getattr(task, "_exception", None)  # read, not retrieved
        ended.append({
            "name": objects.text(task.get_name()),
            "coro": {"qualname": objects.text(getattr(code, "co_qualname", None) or getattr(code, "co_name", None)),
                     "file": objects.text(getattr(code, "co_filename", None), 1000),
                     "line": getattr(code, "co_firstlineno", None),
                     # the globals and attributes it uses, and its own variables (a queue handed in as ``q``)
                     "names": [objects.text(n, 100) for n in (list(getattr(code, "co_names", ()))[:64]
                                                              + list(getattr(code, "co_varnames", ()))[:32])]},
            "ended": time.time(),
            "how": "cancelled" if cancelled else "raised" if exc is not None else "returned",
            "exception": {"type": objects.type_name(exc), "message": objects.text(str(exc), 500)} if exc is not None else None,
        })
    except Exception:  # noqa: BLE001 - a done-callback must never raise into the loop
        pass
