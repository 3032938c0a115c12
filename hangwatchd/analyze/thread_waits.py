"""What one thread waits for, read from its stack, its wait channel and its blocking descriptor.

py-spy gives each thread's Python frames and (with ``--native``) the C frames
under them; ``/proc`` gives the thread's wait channel and the system call it
sleeps in, with the descriptor behind it. From these a thread is put in one of
a few kinds of wait (a lock, a join, a condition and what is built on it, the
GIL, a sleep, a read, a wait on many descriptors, a child process) or found
running. What it waits *for* (whose lock, which thread) is often not in this
evidence; ``process_graph`` connects the waits into a graph, with the
reporter's introspection where there is one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..detect import patterns
from ..detect.patterns import is_user_frame

Frame = dict[str, Any]
Thread = dict[str, Any]

# Kinds of wait.
LOCK, JOIN, CONDITION, EVENT, QUEUE, FUTURE, SEMAPHORE, BARRIER = ("lock", "join", "condition", "event", "queue",
                                                                   "future", "semaphore", "barrier")
POOL, CHILD, GIL, SLEEP, IO, SELECT, RUNNING, UNKNOWN = ("pool", "child", "gil", "sleep", "io", "select", "running",
                                                         "unknown")
MPQUEUE = "process-queue"  # a multiprocessing queue or pipe, or a DataLoader's batch: other processes fill it

_SLEEP_NATIVE = re.compile(r"^(?:__)?(?:clock_)?nanosleep|^time_sleep$|^pysleep$|^usleep$|^sleep$")
_GIL_NATIVE = re.compile(r"^take_gil$|^PyCOND_WAIT|^drop_gil$")
# The GIL's wait as a stripped interpreter shows it: take_gil is static (and inlined), so a thread taking
# the GIL back after a sleep, a read or a lock shows a bare condition-variable wait, while CPython's own
# locks wait on a semaphore (sem_clockwait, do_futex_wait).
_COND_NATIVE = re.compile(r"^(?:__)?pthread_cond_(?:timed|clock)?wait")
_SELECT_NATIVE = re.compile(r"^(?:epoll_wait|epoll_pwait\d?|__?poll|ppoll|select|__select|pselect6?)$")
_IO_NATIVE = re.compile(r"^(?:__libc_)?(?:read|recv|recvfrom|recvmsg|accept4?|write|send|sendto|sendmsg|connect|"
                        r"__libc_open64|open64|__open64_nocancel|openat64|__openat64|readv|writev|pread64)$")
_CHILD_NATIVE = re.compile(r"^(?:wait4|__wait4|waitpid|__waitpid|waitid)$")
_WCHAN_SLEEP = ("hrtimer_nanosleep", "do_nanosleep", "nanosleep")
_WCHAN_IO = ("pipe_read", "pipe_write", "anon_pipe_read", "anon_pipe_write", "unix_stream_read", "sk_wait_data",
             "inet_csk_accept", "wait_woken", "fifo_open", "unix_stream_data_wait", "skb_wait_for_more_packets",
             "sock_wait", "tcp_recvmsg")
_WCHAN_SELECT = ("do_select", "ep_poll", "do_sys_poll", "core_sys_select")
_WCHAN_CHILD = ("do_wait", "kernel_wait4")
_BLOCKING_CALLS = {"read", "pread64", "readv", "recvfrom", "recvmsg", "accept", "accept4", "write", "pwrite64",
                   "writev", "sendto", "sendmsg", "connect", "openat", "flock"}
_MANY_CALLS = {"poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait"}

# Library files whose frames are the machinery of a wait: the program's frame is the first outside them.
_THREADING = "threading.py"
_QUEUE = "queue.py"
_FUTURES = "concurrent/futures/"
_MP = "multiprocessing/"
_ASYNCIO = "asyncio/"


@dataclass(frozen=True)
class Wait:
    kind: str
    frame: Frame | None  # the program's own frame where it waits (or the innermost Python frame)
    call: str | None = None  # the library call it waits in, as a person says it: "Thread.join", "Queue.get", "read"
    how: str = ""  # the evidence: "native frames", "Python frames and the wait channel", ...
    blocked: dict[str, Any] = field(default_factory=dict)  # /proc's blocked_on for the thread, where there is one
    in_event_loop: bool = False  # the wait happens inside an asyncio event loop's callback (it blocks the loop)
    holds_gil: bool = False  # py-spy says this thread holds the GIL
    c_function: str | None = None  # RUNNING or blocked in C of the program's own (not the interpreter's): the C routine
    obj: int | None = None  # the address of the object waited on (the thread joined, the queue, the event), from py-spy's locals


def local_addr(f: Frame | None, name: str) -> int | None:
    """The address of local variable ``name`` of frame ``f`` (``py-spy --locals``), where known."""
    for v in (f or {}).get("locals") or []:
        if isinstance(v, dict) and v.get("name") == name and isinstance(v.get("addr"), int):
            return v["addr"]
    return None


def local_addrs(t: Thread) -> set[int]:
    """Every object a thread's frames hold in a local variable (``py-spy --locals``)."""
    return {v["addr"] for f in t.get("frames") or [] if isinstance(f, dict)
            for v in f.get("locals") or [] if isinstance(v, dict) and isinstance(v.get("addr"), int)}


def thread_object(t: Thread) -> int | None:
    """The address of a thread's own ``threading.Thread`` object: ``self`` of its bootstrap frames."""
    for f in python_frames(t):
        if _file(f).endswith(_THREADING) and _short_name(f).startswith("Thread.") and \
                _short_name(f).rsplit(".", 1)[-1] in ("_bootstrap_inner", "_bootstrap", "run"):
            addr = local_addr(f, "self")
            if addr is not None:
                return addr
    return None


_DELAY_NAMES = re.compile(r"delay|sleep|backoff|wait|interval|seconds|secs|timeout|pause", re.I)


def sleep_seconds(f: Frame | None) -> str | None:
    """How long a frame sleeps, where a local variable named for it says (``delay = 180.0``)."""
    for v in (f or {}).get("locals") or []:
        if isinstance(v, dict) and _DELAY_NAMES.search(str(v.get("name") or "")):
            try:
                value = float(str(v.get("repr")))
            except ValueError:
                continue
            return f"{v['name']} = {value:g} s"
    return None


def python_frames(t: Thread) -> list[Frame]:
    """The thread's Python frames, innermost first; in a child that multiprocessing forked, only its
    own: the frames below ``BaseProcess._bootstrap`` are its parent's, copied at the fork."""
    out = []
    for f in t.get("frames") or []:
        if isinstance(f, dict) and _is_python(f):
            out.append(f)
            if _short_name(f) == "BaseProcess._bootstrap" and _MP in _file(f):
                break
    return out


def _is_python(f: Frame) -> bool:
    """py-spy marks native frames with the module (the library) they are in; a Python frame has none.
    (Code run with ``python -c`` is a Python frame of file ``<string>``.)"""
    name = str(f.get("filename") or "")
    return not f.get("module") and name not in ("", "?") and not name.endswith(".so") and ".so." not in name


def _file(f: Frame | None) -> str:
    return str((f or {}).get("filename") or "")


def _short_name(f: Frame) -> str:
    return str(f.get("name") or "?")


def is_helper_thread(t: Thread) -> bool:
    """A thread of the machinery (a queue feeder, a pool's handler, a watchdog, NCCL's), by its name."""
    name = str(t.get("thread_name") or "")
    return name != "MainThread" and bool(name) and patterns.HELPER_THREAD.search(name)


def user_frame(t: Thread) -> Frame | None:
    """The innermost Python frame of the program's own code (not a library's)."""
    return next((f for f in python_frames(t) if is_user_frame(f)), None)


def where(f: Frame | None, full: bool = False) -> str | None:
    """``function (file.py:line)``: the file by its base name, where a person reads it (``full``: its
    whole path, for the verdict's location)."""
    if f is None:
        return None
    name = _short_name(f)
    if _is_python(f):
        return f"{name} ({_file(f) if full else os.path.basename(_file(f))}:{f.get('line')})"
    return f"{name} ({os.path.basename(_file(f)) or '?'})"


def function(f: Frame | None) -> str | None:
    """The function's own name, without its class (``Registry._evict`` -> ``_evict``)."""
    return _short_name(f).rsplit(".", 1)[-1] if f else None


def call_of(w: Wait) -> str | None:
    """The library call a wait is in, where it is one (not a lock taken in the program's own code,
    a sleep, a read: those are the program's frame itself)."""
    return w.call if w.call and w.kind not in (LOCK, SLEEP, IO, RUNNING, UNKNOWN, GIL) else None


def may_want_gil(t: Thread, w: Wait) -> bool:
    """Could ``t`` be waiting to take the GIL (where another thread is known to hold it and not let it
    go)? Its stack says so (take_gil), or it has no GIL yet runs or waits on nothing known (py-spy's
    "active" is the scheduler's: a thread polling the GIL every 5 ms runs), or it waits on a bare
    condition variable, which is how a stripped interpreter shows take_gil. A thread in C of the
    program's own (which may run without the GIL) is not counted."""
    if t.get("owns_gil") or w.c_function:
        return False
    return w.kind in (GIL, RUNNING, UNKNOWN) or any(_COND_NATIVE.search(n) for n in _natives_above_python(t)[:3])


def _natives_above_python(t: Thread) -> list[str]:
    out = []
    for f in t.get("frames") or []:
        if not isinstance(f, dict):
            continue
        if _is_python(f):
            break
        out.append(str(f.get("name") or ""))
    return out


def _library_call(pys: list[Frame]) -> tuple[str | None, str | None, Frame | None]:
    """(kind, call) from the library frames a wait runs in; (None, None) when the innermost Python
    frame is the program's own. The call the program made decides (the outermost library frame
    under its own): a pool's map waits in an event, a queue's get in a condition, and the map, the
    get say what is waited for."""
    if not pys or is_user_frame(pys[0]):
        return None, None, None
    first_user = next((i for i, f in enumerate(pys) if is_user_frame(f)), len(pys))
    library = pys[:first_user]
    # A forked child's stack goes on below multiprocessing's _bootstrap with the parent's frames (the
    # fork's call site); those are not its wait. Nor is the exit machinery's finalizers' frame chain.
    boot = next((i for i, f in enumerate(library) if _short_name(f).endswith("BaseProcess._bootstrap")), None)
    if boot is not None:
        library = library[:boot]
    library = [f for f in library if not _file(f).endswith(("multiprocessing/util.py",))]
    for f in reversed(library):  # outermost first
        found = _one_call(_short_name(f), _file(f))
        if found is not None:
            return found[0], found[1], f
    return None, None, None


def _one_call(name: str, path: str) -> tuple[str, str] | None:
    """The kind of wait a library frame is, and the call as a person says it (``Queue.get``,
    ``BaseProcess.join``, ``_next_data``); None for a frame that says nothing of the wait."""
    last = name.rsplit(".", 1)[-1]
    shown = ".".join(name.rsplit(".", 2)[-2:])
    if path.endswith(_THREADING):
        if last in ("_wait_for_tstate_lock", "join"):
            return JOIN, "Thread.join"
        for prefix, kind in (("Event.", EVENT), ("Semaphore.", SEMAPHORE), ("BoundedSemaphore.", SEMAPHORE),
                             ("Barrier.", BARRIER), ("Condition.", CONDITION)):
            if name.startswith(prefix):
                return kind, shown
        return None
    if path.endswith(_QUEUE):
        return QUEUE, shown
    if _FUTURES in path:
        if "process.py" in path:
            return POOL, shown
        return FUTURE, shown
    if _MP in path:
        if "pool.py" in path:
            return (MPQUEUE, "the pool's task queue") if last == "worker" else (POOL, shown)
        if "popen" in path or name.startswith("BaseProcess.join"):
            return CHILD, shown
        if "queues.py" in path and last.startswith("_finalize"):
            return None  # a queue's exit-time flush: the join of its feeder thread under it says what waits
        if "queues.py" in path or "connection.py" in path:
            return MPQUEUE, shown
        if "synchronize.py" in path:
            return LOCK, shown
        return None
    if path.endswith("subprocess.py"):  # run() and call() wrap the wait that says which: communicate, wait
        return (CHILD, shown) if last in ("communicate", "wait") else None
    if "torch/utils/data/" in path:
        return MPQUEUE, "_next_data" if last == "__next__" else last
    if _ASYNCIO in path:
        return SELECT, "the asyncio event loop"
    if path.endswith("selectors.py"):
        return SELECT, shown
    return None


def in_event_loop(t: Thread) -> bool:
    """A program frame running inside an asyncio loop's callback: what it blocks in blocks the loop."""
    pys = python_frames(t)
    first_user = next((i for i, f in enumerate(pys) if is_user_frame(f)), None)
    return first_user is not None and any(_ASYNCIO in _file(f) and _short_name(f).endswith(("_run_once", "_run"))
                                          for f in pys[first_user + 1:])


def classify(t: Thread, wchan: str | None = None, blocked: dict[str, Any] | None = None) -> Wait:
    """What thread ``t`` waits for, as far as its own evidence says."""
    pys = python_frames(t)
    mine = user_frame(t)
    frame = mine or (pys[0] if pys else None)
    natives = _natives_above_python(t)
    blocked = blocked if isinstance(blocked, dict) else {}
    loop = in_event_loop(t)
    gil = bool(t.get("owns_gil"))
    lib_kind, lib_call, lib_frame = _library_call(pys)

    def wait(kind: str, call: str | None, how: str, **kw: Any) -> Wait:
        obj = local_addr(lib_frame, "self") if lib_frame is not None and call == lib_call else None
        return Wait(kind, frame, call, how, blocked, loop, gil, obj=obj, **kw)

    if t.get("active"):
        return wait(RUNNING, None, "py-spy saw it on the CPU", c_function=_own_c(t, natives) if not _runtime_native(t) else None)
    if any(_GIL_NATIVE.search(n) for n in natives[:6]):
        return wait(GIL, "the GIL", "native frames (take_gil)")
    said = blocked.get("syscall")  # the capture's word, read from a file the user could shape: a name or nothing
    syscall = (said if isinstance(said, str) else None) or _call_from_text(blocked)
    # The descriptor or child a call blocks on is the most direct evidence there is.
    if syscall in _BLOCKING_CALLS or (not syscall and any(_IO_NATIVE.search(n) for n in natives[:3])):
        writing = str(syscall or "").startswith(("write", "pwrite", "send"))
        if lib_kind in (CHILD, POOL, MPQUEUE) and not writing:  # a write is blocked on its reader, not waiting for work
            return wait(lib_kind, lib_call, "library frames and the blocking descriptor")
        return wait(IO, _io_call(syscall, natives), "the system call and its descriptor" if syscall else "native frames",
                    c_function=_own_c(t, natives))
    if syscall in _MANY_CALLS or any(_SELECT_NATIVE.search(n) for n in natives[:3]) \
            or (not natives and wchan in _WCHAN_SELECT):
        if lib_kind in (CHILD, POOL, MPQUEUE):
            return wait(lib_kind, lib_call, "library frames")
        return wait(SELECT, lib_call or syscall or "select", "the system call" if syscall else "native frames")
    if syscall in ("wait4", "waitid") or any(_CHILD_NATIVE.search(n) for n in natives[:3]) \
            or (not natives and wchan in _WCHAN_CHILD):
        return wait(CHILD, lib_call or "os.waitpid", "the system call" if syscall else "native frames")
    if syscall in ("nanosleep", "clock_nanosleep") or any(_SLEEP_NATIVE.search(n) for n in natives[:4]) \
            or (not natives and wchan in _WCHAN_SLEEP):
        # time.sleep lets the GIL go: a sleeper that holds it sleeps in C (a library through ctypes.PyDLL, an extension).
        c = _own_c(t, natives) or (next((n for n in natives if _SLEEP_NATIVE.search(n)), "sleep") + "()" if gil else None)
        return wait(SLEEP, "time.sleep", "native frames" if natives else "the wait channel", c_function=c)
    if lib_kind is not None:
        return wait(lib_kind, lib_call, "library frames")
    if any(patterns.LOCK_NATIVE.search(n) for n in natives):
        return wait(LOCK, "a lock", "native frames")
    if pys and _short_name(pys[0]).endswith(("acquire", "__enter__")):
        return wait(LOCK, "a lock", "Python frames")
    if not natives and wchan and "futex" in wchan and mine is not None and pys and pys[0] is mine:
        return wait(LOCK, "a lock", "the wait channel (a futex) under the program's own frame")
    if wchan in _WCHAN_IO:
        return wait(IO, wchan, "the wait channel")
    return wait(UNKNOWN, None, "nothing in its stack or /proc says")


_TEXT_CALLS = (("reading", "read"), ("receiving", "recvfrom"), ("accepting", "accept"), ("writing", "write"),
               ("sending", "sendto"), ("connecting", "connect"), ("opening", "openat"), ("locking", "flock"),
               ("waiting in", "poll"), ("waiting for a child", "wait4"), ("sleeping", "nanosleep"))


def _call_from_text(blocked: dict[str, Any]) -> str | None:
    """The system call a ``blocked_on`` made by hand (or by an older capture) names only in its text."""
    text = blocked.get("text")
    if not isinstance(text, str) or blocked.get("syscall") is not None and "syscall" in blocked:
        return None
    for verb, call in _TEXT_CALLS:
        if text.startswith(verb):
            return call
    return None


def _io_call(syscall: Any, natives: list[str]) -> str:
    if isinstance(syscall, str) and syscall:
        return syscall
    for n in natives:
        if _IO_NATIVE.search(n):
            return n.lstrip("_").replace("libc_", "")
    return "a read"


_RUNTIME = ("libpython", "python3", "python", "libc.so", "libpthread", "ld-linux", "libffi")


def _runtime_native(t: Thread) -> bool:
    frames = [f for f in t.get("frames") or [] if isinstance(f, dict)]
    if not frames or _is_python(frames[0]):
        return True
    lib = str(frames[0].get("short_filename") or frames[0].get("module") or frames[0].get("filename") or "")
    return os.path.basename(lib).startswith(_RUNTIME) or lib.startswith(patterns.GPU_LIBRARIES)


def _own_c(t: Thread, natives: list[str]) -> str | None:
    """The program's own C routine (a library called through ctypes, an extension) among the native
    frames above the innermost Python frame, named as the frame names it."""
    for f in t.get("frames") or []:
        if not isinstance(f, dict) or _is_python(f):
            break
        lib = os.path.basename(str(f.get("short_filename") or f.get("module") or f.get("filename") or ""))
        if lib and not lib.startswith(_RUNTIME) and not lib.startswith(("libffi", "_ctypes")) and ".so" in lib:
            return f"{f.get('name')} ({lib})"
    return None
