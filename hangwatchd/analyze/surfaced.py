"""Where a GPU exception surfaced in the program, and how its kernel is told.

A kernel's fault is reported to the host at the next call that waits for the
GPU (a synchronise, a copy to the host, ``Tensor.item``), often lines after the
launch. When the daemon caught the exception alive (its FIFO), the thread in that
call is still there: the one whose stack is inside the CUDA driver or in a
PyTorch call that waits for the GPU (``patterns.GPU``). Its innermost frame of
the program's own is where the error surfaced; a CUDA graph's replay on the
stack is named as such. Helper threads (PyTorch's, NCCL's) are passed over.
"""

from __future__ import annotations

import io
import os
import re
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..detect import patterns
from ..detect.patterns import is_user_frame
from . import threads as th

ASYNC_NOTE = ("with asynchronous launches the line where a GPU error surfaces can be later than the one that "
              "launched the kernel (CUDA_LAUNCH_BLOCKING=1 makes them the same)")
_GRAPH = re.compile(r"(?:^|\.)replay$|\bcu(?:da)?GraphLaunch")
REPLAY_TEXT = "the last replay of a CUDA graph in that thread"  # where its kernels were launched from
LONG_NAME = 100  # characters past which a kernel's or function's name loses its template arguments


@dataclass(frozen=True)
class Surfaced:
    thread: str  # the thread's name
    main: bool
    frame: dict[str, Any]  # the program's innermost frame in that thread
    call: str | None  # the waiting call the stack shows (cudaStreamSynchronize, item)
    graph: dict[str, Any] | None  # the program's frame that replays a CUDA graph, where the stack shows one
    replay: dict[str, Any] | None = None  # else the thread's last replay of a graph, as its reporter told it

    @property
    def location(self) -> str:
        return f"{self.frame.get('name')} ({self.frame.get('filename')}:{self.frame.get('line')})"

    def text(self) -> str:
        """``in `print(data[index])` (x.py:26)``, ``in thread model-runner at run_model (x.py:48)``, or
        ``in the replay of a CUDA graph at <module> (x.py:12)``."""
        where = _said(self.frame)
        if self.graph is self.frame:
            where = f"the replay of a CUDA graph at {where}"
        elif self.graph is not None:
            where = f"{where}, in the replay of a CUDA graph at {_said(self.graph)}"
        elif self.replay is not None:
            where = f"{where}, after {REPLAY_TEXT} at {_said(self.replay)}"
        return where if self.main else f"thread {self.thread} at {where}"


def _said(f: dict[str, Any]) -> str:
    """A frame as the verdict says it: its line of code where the capture read it, else its function."""
    code = without_comment(f.get("code") or "") if isinstance(f.get("code"), str) else ""
    if code:
        return f"`{code}` ({os.path.basename(str(f.get('filename') or '?'))}:{f.get('line')})"
    return th.short(f)


def in_traceback(frames: tuple[dict[str, Any], ...], replay: dict[str, Any] | None = None) -> str:
    """``; it surfaced in `print(x.item())` (x.py:33), after the replay of a CUDA graph at `g.replay()`
    (x.py:32); with asynchronous ...`` from the traceback the program died of after the driver's
    report (its innermost frame of the program's own) and the dying thread's last graph replay (the
    reporter's word), or ""."""
    own = [f for f in frames if is_user_frame(f)]
    if not own:
        return ""
    after = f", after {REPLAY_TEXT} at {_said(replay)}" if replay else ""
    return f"; it surfaced in {_said(own[-1])}{after}; {ASYNC_NOTE}"


def without_comment(line: str) -> str:
    """A line of Python without its trailing comment (a ``#`` inside a string stays)."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                return line[: tok.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass  # a statement that goes on over the next lines: no comment was met before its end
    return line.strip()


def replays(report: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """Each thread's last CUDA graph replay from the process's own report (``introspect.json``), as a
    frame in py-spy's keys, by its native id and by its ident (the report is read, never trusted
    for its shape)."""
    out: dict[int, dict[str, Any]] = {}
    threads = (report or {}).get("threads")
    for t in threads if isinstance(threads, list) else []:
        r = t.get("graph_replay") if isinstance(t, dict) else None
        if not isinstance(r, dict) or not isinstance(r.get("line"), int) or not isinstance(r.get("file"), str):
            continue
        frame = {"name": str(r.get("function") or "?")[:200], "filename": r["file"][:1000], "line": r["line"]}
        if isinstance(r.get("code"), str):
            frame["code"] = r["code"][:200]
        for key in ("native_id", "ident"):
            if isinstance(t.get(key), int):
                out[t[key]] = frame
    return out


def in_evidence(threads: Sequence[dict[str, Any]], report: dict[str, Any] | None) -> Surfaced | None:
    """``find`` over a process's stacks, with the replays its own report tells of."""
    return find(list(threads), replays(report))


def find(threads: list[dict[str, Any]], told: dict[int, dict[str, Any]] | None = None) -> Surfaced | None:
    """The thread the exception surfaced in, and the program's line there; None when no thread is in
    a call that waits for the GPU (stacks of another moment, or none). ``told``: each thread's last
    graph replay by its native id or ident (``replays``), said where no replay is on its stack."""
    best: tuple[int, int, Surfaced] | None = None
    for order, t in enumerate(th.ordered(threads)):
        frames = [f for f in t.get("frames") or [] if isinstance(f, dict)]
        names = [str(f.get("name") or "") for f in frames]
        native = next((n for n in names if patterns.GPU_NATIVE.search(n)), None)
        python = next((str(f.get("name")) for f in frames if th.is_python(f) and patterns.GPU_PYTHON.search(str(f.get("name") or ""))), None)
        in_driver = any(patterns.DRIVER_LIBRARY in str(f.get("filename") or f.get("module") or "") for f in frames)
        score = 3 if native else 2 if python and in_driver else 1 if python or in_driver else 0
        mine = next((f for f in frames if is_user_frame(f) and th.is_python(f)), None)
        if not score or mine is None:
            continue
        graph = None
        for i, f in enumerate(frames):
            if _GRAPH.search(str(f.get("name") or "")):
                graph = next((g for g in frames[i + 1:] if is_user_frame(g) and th.is_python(g)), None)
                break
        replay = None
        if graph is None and told:
            replay = told.get(t.get("os_thread_id")) or told.get(t.get("thread_id"))  # type: ignore[arg-type]
        found = Surfaced(str(t.get("thread_name") or t.get("os_thread_id") or "?"), th.is_main(t), mine,
                         native or python, graph, replay)
        if best is None or (score, -order) > best[:2]:
            best = (score, -order, found)
    return best[2] if best else None


def short_name(name: str) -> str:
    """A C++ name a person can read in a sentence: past LONG_NAME characters, template arguments as
    ``<…>`` and the parameter list as ``(…)``."""
    if len(name) <= LONG_NAME:
        return name
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            if depth == 0:
                out.append("<…>")
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    text = "".join(out)
    if len(text) > LONG_NAME and "(" in text:
        text = text[: text.index("(")] + "(…)"
    return text.removeprefix("void ")


def kernel_chain(frames: list[dict[str, Any]]) -> str:
    """The kernel's source lines, innermost first, each inlined into the next: ``store_at(int*, long,
    int) (inlined.cu:9) ← epilogue(int*, long, int) (inlined.cu:13) ← faulty_epilogue_kernel(int*,
    long) (inlined.cu:17)``; "" without line information."""
    parts = [f"{short_name(str(f.get('function') or '?'))} ({os.path.basename(str(f.get('file')))}:{f.get('line')})"
             for f in frames if f.get("file")]
    return " ← ".join(parts)
