"""A thread holds the GIL in a blocking C call: ``read_frame`` (thread reader) calls libc
``read()`` through ``ctypes.PyDLL``, which does not release the GIL, on a pipe that nobody
writes. The read never returns, so the GIL is never released: the main thread cannot run a
single line of Python (it is stuck taking the GIL back after a sleep). The reader starts its
read once the main thread is in its loop: on a stripped interpreter (Debian's) that wait shows
as a bare condition-variable wait, and py-spy may even call the thread active.

Reports: python/cpython#114150 (PyDLL/PYFUNCTYPE calls keep the GIL); giampaolo/psutil#177
("GIL is not released" around blocking system calls in C code).
"""

import ctypes
import os
import threading
import time

CASE = {
    "title": "GIL held in a blocking read (ctypes.PyDLL read on a silent pipe)",
    "source": "python/cpython#114150; giampaolo/psutil#177 (a blocking C call that keeps the GIL)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["read_frame", "reader"],
    "cause": r"GIL",
    "hangs_after": 1,
}

libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
frames_r, frames_w = os.pipe()  # the write end is kept, and never written


def read_frame() -> bytes:
    time.sleep(0.5)  # the main thread is back in its loop by then
    buf = ctypes.create_string_buffer(4096)
    n = libc.read(frames_r, buf, 4096)
    return buf.raw[:n]


def main() -> None:
    threading.Thread(target=read_frame, name="reader", daemon=True).start()
    while True:
        time.sleep(0.2)  # to run again, this thread needs the GIL back


if __name__ == "__main__":
    main()
