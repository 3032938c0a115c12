"""Where each thread last replayed a CUDA graph: the line a graph's faulting kernel was launched from.

A kernel in a CUDA graph runs when the graph is replayed, and its fault reaches
the host later, at the next call that waits for the GPU: the stacks and the
traceback name that later line, and no stack still holds the replay. So from
install on, ``torch.cuda.graphs.CUDAGraph.replay`` (what ``g.replay()``,
``make_graphed_callables`` and ``torch.compile``'s CUDA graph trees call) notes,
per thread, its caller: the innermost frame outside torch's own package, its
code object and line, and when. That is one frame walk and a dict store a replay
(0.6 µs on a CI machine, against a graph launch's tens); no text is made until asked.

It is told two ways. The report has it per thread (``graph_replay``), for a
process caught alive (the daemon's exception FIFO). And when a thread dies of a
CUDA error (torch's ``AcceleratorError``, or a message that says "CUDA error"),
three lines follow the traceback on stderr, in the traceback's own form, which
``hangwatchd run``'s stderr tee keeps beside the driver's report::

    hangwatchd: the last CUDA graph replay in this thread before the error:
      File "/srv/app/graph_ima.py", line 32, in <module>
        g.replay()

torch is never imported for this: the wrap waits for the program to import it.
"""

from __future__ import annotations

import _thread
import linecache
import os
import sys
import time
import types
from typing import Any

from . import imports, objects

HEADER = "hangwatchd: the last CUDA graph replay in this thread before the error:"  # as driverlog.REPLAY_HEADER
MODULE = "torch.cuda.graphs"
THREADS = 64  # threads remembered, the most recent replayers
DEPTH = 64  # frames walked out of torch's own

last: dict[int, tuple[types.CodeType, int, float]] = {}  # thread ident -> (code, line, time.time()) of its last replay
_torch_dir = ""
_done = False
_original_excepthook: Any = None


def install() -> None:
    """Wrap the replay now if torch's graphs are loaded, else when they are."""
    imports.when_imported(MODULE, _wrap)


def _wrap(module: types.ModuleType) -> None:
    """The replay, and the main thread's exception hook (to tell the replay after a CUDA error's
    traceback): only in a process that has CUDA graphs to replay."""
    global _done, _torch_dir, _original_excepthook
    graph = getattr(module, "CUDAGraph", None)
    original = getattr(graph, "replay", None)
    if _done or graph is None or not callable(original):
        return
    _done = True
    _original_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    _torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(str(module.__file__)))) + os.sep

    def replay(self: object, *args: Any, **kwargs: Any) -> Any:
        try:
            _note(sys._getframe(1))
        except Exception:  # noqa: BLE001 - noting must never keep a graph from replaying
            pass
        return original(self, *args, **kwargs)

    replay.__doc__ = original.__doc__
    graph.replay = replay


def _note(frame: types.FrameType | None) -> None:
    for _ in range(DEPTH):
        if frame is None:
            return
        code = frame.f_code
        if not code.co_filename.startswith(_torch_dir):
            ident = _thread.get_ident()
            last.pop(ident, None)
            last[ident] = (code, frame.f_lineno, time.time())
            while len(last) > THREADS:
                last.pop(next(iter(last)), None)
            return
        frame = frame.f_back


def of_thread(ident: int) -> dict[str, Any] | None:
    """The report's ``graph_replay`` of a thread: where and when it last replayed a graph."""
    rec = last.get(ident)
    if rec is None:
        return None
    code, line, when = rec
    return {"function": objects.qualname(code), "file": objects.text(code.co_filename, 1000), "line": line, "time": when}


def is_cuda_error(exc: BaseException | None) -> bool:
    if exc is None:
        return False
    if any(t.__name__ == "AcceleratorError" for t in type(exc).__mro__):
        return True
    try:
        return "CUDA error" in str(exc)[:500]
    except Exception:  # noqa: BLE001 - an exception whose str() fails is not told as a CUDA error
        return False


def tell(exc: BaseException | None) -> None:
    """After a CUDA error's traceback, on stderr: the dying thread's last replay of a graph, if any."""
    try:
        rec = last.get(_thread.get_ident())
        if rec is None or not is_cuda_error(exc) or sys.stderr is None:
            return
        code, line, _ = rec
        text = linecache.getline(code.co_filename, line).strip()
        sys.stderr.write(f'{HEADER}\n  File "{code.co_filename}", line {line}, in {code.co_name}\n'
                         + (f"    {text}\n" if text else ""))
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - telling must never fail an exit
        pass


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
    (_original_excepthook or sys.__excepthook__)(exc_type, exc, tb)
    tell(exc)
