"""A child that dies with its parent: PR_SET_PDEATHSIG, set between fork and exec.

``hangwatchd run`` killed (even by SIGKILL) must not leave its workload
running unwatched and unregistered, and a daemon killed must not leave its
py-spy children behind. The kernel sends the signal when the thread that
forked the child exits, so fork from a thread that lives as long as the
parent's interest in the child (the main thread, or a pool worker).
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now: nothing to look up in the forked child
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """In the child, before exec: receive ``sig`` when the parent dies; exit now if it is already gone."""
    _prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl: no signal will come
        os._exit(1)
