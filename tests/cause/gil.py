"""A main thread that calls a C routine spinning for ever with the GIL held (ctypes.PyDLL keeps
the GIL during the call); a helper thread can then never run Python again.

    python gil.py LIBSPIN.so
"""

import ctypes
import sys
import threading
import time


def tick() -> None:
    while True:
        time.sleep(0.01)


def checksum(lib: ctypes.PyDLL) -> None:
    lib.spin_forever()


def main(path: str) -> None:
    lib = ctypes.PyDLL(path)
    threading.Thread(target=tick, name="ticker", daemon=True).start()
    print("READY", flush=True)
    checksum(lib)


if __name__ == "__main__":
    main(sys.argv[1])
