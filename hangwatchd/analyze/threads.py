"""Which thread to read, and what the threads do to each other: a lock-order deadlock, a thread that
holds the GIL while spinning in C.

A process's verdict reads its main thread first: queue feeders, pin-memory
threads, watchdogs and NCCL's threads wait in locks and conditions all the
time, busy or hung, and are named only when they are the cause.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..detect import patterns
from ..detect.patterns import is_user_frame

Thread = dict[str, Any]
Frame = dict[str, Any]

# Native code that is the interpreter or the C library, not a C routine of the program's.
_RUNTIME = ("libpython", "python3", "python", "libc.so", "libpthread", "ld-linux", "libffi")


def is_python(frame: Frame) -> bool:
    return not frame.get("module") and str(frame.get("filename") or "").endswith(".py")


def is_main(t: Thread, pid: int | None = None) -> bool:
    return t.get("thread_name") == "MainThread" or (pid is not None and t.get("os_thread_id") == pid)


def is_helper(t: Thread) -> bool:
    """A thread of the machinery (a queue feeder, pin-memory, a watchdog, NCCL's), by name or frames."""
    if is_main(t):
        return False
    names = [str(t.get("thread_name") or "")] + [str(f.get("name") or "") for f in t.get("frames") or []]
    return any(patterns.HELPER_THREAD.search(n) for n in names if n)


def ordered(threads: list[Thread], pid: int | None = None) -> list[Thread]:
    """The threads to read, main thread first, the program's own next; helpers left out."""
    mains = [t for t in threads if is_main(t, pid)]
    rest = [t for t in threads if t not in mains and not is_helper(t)]
    return mains + rest


def main_thread(threads: list[Thread], pid: int | None = None) -> Thread | None:
    return next((t for t in threads if is_main(t, pid)), threads[0] if len(threads) == 1 else None)


def short(frame: Frame) -> str:
    """``function (file.py:line)``: where a person looks, the file by its base name."""
    name = str(frame.get("name") or "?").rsplit(".", 1)[-1] if is_python(frame) else str(frame.get("name") or "?")
    where = frame.get("short_filename") or os.path.basename(str(frame.get("filename") or "")) or "?"
    return f"{name} ({os.path.basename(str(where))}:{frame.get('line')})" if is_python(frame) else f"{name} ({where})"


def innermost_user_frame(t: Thread) -> Frame | None:
    return next((f for f in t.get("frames") or [] if is_user_frame(f) and is_python(f)), None)


def lock_blocked_at(t: Thread, wchans: dict[int, str]) -> Frame | None:
    """The user frame where the thread waits to take a lock (inside a ``with`` or at an ``acquire``), if it does.

    With native frames: lock-taking C frames right under the innermost Python frame, and that
    frame the program's own (a join or a condition wait runs in threading.py). With Python frames
    only: the program's frame innermost, the thread idle, and the kernel has it waiting on a futex.
    """
    frames = [f for f in t.get("frames") or [] if isinstance(f, dict)]
    first_py = next((i for i, f in enumerate(frames) if is_python(f)), None)
    if first_py is None:
        return None
    py = frames[first_py]
    below = [str(f.get("name") or "") for f in frames[:first_py]]
    if below:
        if any(patterns.LOCK_NATIVE.search(n) for n in below) and is_user_frame(py):
            return py
        return None
    if str(py.get("name") or "").endswith(("acquire", "__enter__")):
        outer = next((f for f in frames[first_py + 1 :] if is_python(f)), None)
        return outer if outer is not None and is_user_frame(outer) else None
    tid = t.get("os_thread_id")
    wchan = wchans.get(tid) if isinstance(tid, int) else None
    if is_user_frame(py) and not t.get("active") and wchan and "futex" in wchan:
        return py
    return None


def deadlock(threads: list[Thread], wchans: dict[int, str]) -> list[tuple[Thread, Frame]] | None:
    """Two or more threads each waiting to take a lock in the program's code, and no thread running."""
    blocked = [(t, f) for t in threads if (f := lock_blocked_at(t, wchans)) is not None]
    if len(blocked) < 2 or any(t.get("active") for t in threads):
        return None
    # In the order they were started (thread ids grow); a hand-made file may hold anything there.
    return sorted(blocked, key=lambda b: b[0]["os_thread_id"] if isinstance(b[0].get("os_thread_id"), int) else 0)


def deadlock_text(blocked: list[tuple[Thread, Frame]]) -> str:
    parts = [f"{t.get('thread_name') or t.get('os_thread_id')} ({short(f).replace(' (', ', ', 1)}" for t, f in blocked]
    return "deadlock between threads " + (", ".join(parts[:-1]) + " and " + parts[-1])


@dataclass(frozen=True)
class GilSpin:
    thread: Thread
    native: Frame  # the C routine it spins in
    caller: Frame | None  # the Python frame that called it


def gil_spin(threads: list[Thread]) -> GilSpin | None:
    """A thread that holds the GIL and runs C code of the program's own (not the interpreter's)."""
    for t in threads:
        frames = [f for f in t.get("frames") or [] if isinstance(f, dict)]
        if not (t.get("owns_gil") and t.get("active") and frames) or is_python(frames[0]):
            continue
        lib = str(frames[0].get("short_filename") or frames[0].get("module") or "")
        if lib.startswith(_RUNTIME) or lib.startswith(patterns.GPU_LIBRARIES):
            continue
        caller = next((f for f in frames if is_python(f) and is_user_frame(f)), None) or next(
            (f for f in frames if is_python(f)), None)
        return GilSpin(t, frames[0], caller)
    return None


_GENERIC = frozenset({"get", "wait", "join", "recv", "result", "map", "poll", "communicate", "_recv", "recv_bytes"})


def call_name(frame: Frame) -> str:
    """A frame's function as a person says it: ``_next_data``, but ``Queue.get`` (a bare ``get`` says little)."""
    name = str(frame.get("name") or "?")
    last = name.rsplit(".", 1)[-1]
    return ".".join(name.rsplit(".", 2)[-2:]) if last in _GENERIC and "." in name else last


def child_wait(t: Thread) -> Frame | None:
    """The outermost frame of the libraries that run children where the thread waits for one."""
    for f in reversed([f for f in t.get("frames") or [] if isinstance(f, dict)]):
        name = str(f.get("name") or "")
        in_lib = any(m in str(f.get("filename") or "") for m in patterns.CHILD_WAIT_FILES)
        if (in_lib or not is_python(f)) and patterns.CHILD_WAIT.search(name):
            if not is_python(f) and not name.startswith(("wait4", "waitpid", "__waitpid")):
                continue
            return f
    return None
