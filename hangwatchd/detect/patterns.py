"""The one catalogue of stack-frame patterns: what a frame says a thread waits on.

The stack detector (is a frozen stack blocked or idle?), the GPU-dump gate (is
the host inside the CUDA driver or NCCL?) and the verdict (what was each
process doing?) all read frames; they read them through this catalogue so
that they cannot disagree. Patterns are regular expressions searched in a
frame's function name (py-spy's ``name``), native and Python frames alike;
the *_NATIVE kinds name what only a native stack shows, and only those may
open the way to a GPU dump (a Python frame named all_reduce may be gloo).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    name: str  # gpu, collective, lock, idle
    pattern: str

    def search(self, frame_name: str) -> bool:
        return _compiled(self.pattern).search(frame_name) is not None


# The host waits for the GPU: the driver's and the runtime's synchronising calls, the
# blocking copies (a device-to-host copy waits for the stream ahead of it), and launches
# (a launch blocks when the queue is full behind a stream that does not move).
GPU_NATIVE = Kind("gpu", r"\bcu(?:da)?\w*Synchronize\b|\bcuMemcpy\w*\b|\bcudaMemcpy\w*\b|\bcuStreamWait\w+|\bcudaStreamWait\w+"
                         r"|\bcuStreamQuery\b|\bcuEventQuery\b|\bcu(?:da)?GraphLaunch\w*|\bcu(?:da)?LaunchKernel\w*")
# PyTorch calls that wait for the GPU, as the Python stack shows them.
GPU_PYTHON = Kind("gpu", r"^(?:\w+\.)*(?:synchronize|item|cpu|tolist|__repr__|__str__)$")
# Inside an NCCL collective or a wait on one, as the native stack shows it. Named calls
# only: every NCCL process has proxy and watchdog threads (ncclProxyService,
# ProcessGroupNCCL::ncclCommWatchdog) sitting in NCCL all the time, busy or hung.
COLLECTIVE_NATIVE = Kind("collective", r"\bnccl(?:AllReduce|AllGather|Broadcast|Bcast|Reduce|ReduceScatter|AlltoAll"
                                       r"|AllToAll|Send|Recv|GroupEnd)\b|WorkNCCL::(?:wait|synchronize)\b"
                                       r"|ProcessGroupNCCL::(?:barrier|allreduce|allgather|broadcast|reduce_scatter|alltoall)")
# A collective as the Python stack shows it (any backend: gloo waits here too). Not a bare
# send/recv: multiprocessing's Connection.recv is an idle worker pool, not a collective.
COLLECTIVE_PYTHON = Kind("collective", r"^(?:\w+\.)*(?:all_reduce\w*|all_gather\w*|_all_gather_base|reduce_scatter\w*"
                                       r"|_reduce_scatter_base|broadcast\w*|barrier|monitored_barrier|all_to_all\w*"
                                       r"|batch_isend_irecv|wait_tensor)$")
# Locks, joins and condition waits. Not take_gil or a bare pthread_mutex_lock: a busy
# process is caught in those all the time, and a thread waiting for the GIL says the
# holder is the one to look at.
LOCK = Kind("lock", r"acquire|lock_PyThread|_wait_for_tstate_lock"
                    r"|^(?:\w+\.)*join$|Condition\.wait|Event\.wait|Semaphore\.acquire")
# Where a server waits for work: a frozen stack here is idleness, not a hang.
IDLE = Kind("idle", r"selectors|select\.|epoll|asyncio|_run_once|accept|zmq|uvloop|serve_forever|Queue\.get"
                    r"|recv_pyobj")

# A parent waiting for its worker processes or subprocesses: a DataLoader's next batch, a pool's
# map, a process's join, a subprocess's wait. Counted only in the frames of the libraries that
# run children (CHILD_WAIT_FILES), or native waits for a child; the cause is then in a child.
CHILD_WAIT = Kind("child-wait", r"^(?:\w+\.)*(?:_next_data|_get_data|_try_get_data|communicate|waitpid|wait4|join|wait|get"
                                r"|map|starmap|imap\w*|result|recv|recv_bytes|poll|_recv)$|^wait4$|^waitpid$|^__waitpid$")
CHILD_WAIT_FILES = ("multiprocessing/", "torch/utils/data/", "subprocess.py", "concurrent/futures/process.py")
# Threads that are machinery, not the program: queue feeders, pin-memory, pools' handlers,
# watchdogs and NCCL's and PyTorch's own threads. Named only when they are the cause.
HELPER_THREAD = Kind("helper", r"QueueFeederThread|_pin_memory_loop|pin_memory|^pt_|watchdog|Watchdog|NCCL|nccl"
                               r"|_handle_workers|_handle_tasks|_handle_results|hangwatchd")
# A thread blocked taking a lock, as the native frames under its innermost Python frame show it.
LOCK_NATIVE = Kind("lock", r"PyThread_acquire_lock|lock_PyThread_acquire_lock|acquire_timed|rlock_acquire|lock_enter"
                           r"|pthread_mutex_lock|__lll_lock_wait")

# Blocking kinds, in the order the verdict tells them apart: a thread in NCCL that also
# synchronises is in a collective; one in a lock inside a collective is in the collective.
COLLECTIVE = (COLLECTIVE_NATIVE, COLLECTIVE_PYTHON)
GPU = (GPU_NATIVE, GPU_PYTHON)
BLOCKING = (*GPU, *COLLECTIVE, LOCK)

# Libraries whose native frames mean the thread is inside the CUDA driver or NCCL (a
# hung process blocked there, even in cuLaunchKernel behind a full queue, waits on the GPU).
GPU_LIBRARIES = ("libcuda.so", "libnccl.so")
DRIVER_LIBRARY = "libcuda.so"


# Where library code lives; a frame elsewhere is the user's own code.
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", "/hangwatchd/workload/client.py",
                    "/hangwatchd/workload/introspect/")  # the in-process reporter: its thread, its wrapper of every thread


def is_user_frame(frame: dict[str, Any]) -> bool:
    """Whether a py-spy frame is the program's own code (not a library's, not native)."""
    filename = frame.get("filename") or ""
    if frame.get("module") or filename.endswith(".so") or ".so." in filename:
        return False  # native code
    if filename in ("", "?"):
        # py-spy's "0x4ce7c3 (?)": a native frame it could not name (a binary only the
        # process's own mount namespace holds, say). Unknown code is nobody's code.
        return False
    return not any(m in filename for m in _LIBRARY_MARKERS)


def first(names: Iterable[str], kinds: Iterable[Kind]) -> str | None:
    """The first frame name matching any of ``kinds``, trying kind by kind (earlier kinds say more)."""
    listed = list(names)
    for kind in kinds:
        for name in listed:
            if kind.search(name):
                return name
    return None


def blocking_patterns() -> tuple[str, ...]:
    """The blocking kinds' patterns, for a detector that takes extra ones from the config."""
    return tuple(k.pattern for k in BLOCKING)


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)
