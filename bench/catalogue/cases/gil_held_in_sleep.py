"""A thread holds the GIL in a C sleep: ``rate_limit`` (thread throttle) calls libc
``sleep(3600)`` through ``ctypes.PyDLL`` (a wrapper generated for the C API, used for a plain
C function), so the whole interpreter stops for an hour: the main thread cannot take the GIL
back after its own short sleep.

Reports: python/cpython#114150 (a call that holds the GIL for its whole duration);
joblib/threadpoolctl#239 (PyDLL keeping the GIL held while another thread needs it).
"""

import ctypes
import threading
import time

CASE = {
    "title": "GIL held in sleep() through ctypes.PyDLL",
    "source": "python/cpython#114150; joblib/threadpoolctl#239 (PyDLL holds the GIL during the call)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["rate_limit", "throttle"],
    "cause": r"GIL",
    "hangs_after": 1,
}

libc = ctypes.PyDLL(None)


def rate_limit() -> None:
    libc.sleep(3600)


def main() -> None:
    threading.Thread(target=rate_limit, name="throttle", daemon=True).start()
    while True:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
