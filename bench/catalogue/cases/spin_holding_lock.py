"""A thread spins in pure Python while holding a lock: ``wait_for_device`` (thread poller)
takes the device lock and busy-waits on a flag that only a thread taking the same lock could
set. The main thread waits for the lock; the poller burns a core forever. One thread spins;
nothing else does.

Report: 1bit-MONSTER/1bit-MONSTER#405 ("spin-wait loop has no timeout": a spin on a flag
nobody sets; here in Python, under a lock).
"""

import threading
import time

CASE = {
    "title": "pure-Python spin while holding a lock others need",
    "source": "1bit-MONSTER/1bit-MONSTER#405 (a spin-wait on a flag that is never set)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["wait_for_device", "poller"],
    "cause": r"spin|busy",
    "hangs_after": 0.5,
}

device_lock = threading.Lock()
device_ready = False  # set by mark_ready, which needs device_lock


def wait_for_device() -> None:
    with device_lock:
        while not device_ready:
            pass


def mark_ready() -> None:
    global device_ready
    with device_lock:
        device_ready = True


def main() -> None:
    threading.Thread(target=wait_for_device, name="poller", daemon=True).start()
    time.sleep(0.1)
    mark_ready()


if __name__ == "__main__":
    main()
