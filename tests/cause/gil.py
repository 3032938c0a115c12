"""A program whose main thread calls a C routine that spins for ever while holding the GIL (ctypes.PyDLL
keeps the GIL held during the call); a helper thread waits for the GIL.

    python gil.py LIBSPIN.so
"""

import ctypes
import sys
import threading
import time


def heartbeat() -> None:
    while True:
        time.sleep(0.01)


def checksum(lib: ctypes.PyDLL) -> None:
    lib.spin_forever()


def main(path: str) -> None:
    lib = ctypes.PyDLL(path)
    threading.Thread(target=heartbeat, name="beat", daemon=True).start()
    print("READY", flush=True)
    checksum(lib)


if __name__ == "__main__":
    main(sys.argv[1])
