"""Three threads in a lock cycle: loader holds A wants B, trainer holds B wants C, saver holds
C wants A. No two of them deadlock alone; the cycle needs all three, which is what makes it
hard to see from any one stack. A barrier makes every thread hold its first lock before any
asks for its second.

Report: vespa-engine/vespa#4850, "Remove synchronization, it leads to deadlocks": a lock, a
monitor and a curator lock taken in a circle by several threads.
"""

import threading

CASE = {
    "title": "lock cycle of 3 threads",
    "source": "vespa-engine/vespa#4850 (a circle of locks across threads)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["load_batch", "apply_update", "save_snapshot", "loader", "trainer", "saver"],
    "cause": r"deadlock|cycle",
    "hangs_after": 1,
}

data_lock, model_lock, disk_lock = threading.Lock(), threading.Lock(), threading.Lock()
all_hold_one = threading.Barrier(3)


def load_batch() -> None:
    with data_lock:
        all_hold_one.wait()
        with model_lock:
            pass


def apply_update() -> None:
    with model_lock:
        all_hold_one.wait()
        with disk_lock:
            pass


def save_snapshot() -> None:
    with disk_lock:
        all_hold_one.wait()
        with data_lock:
            pass


def main() -> None:
    threads = [threading.Thread(target=load_batch, name="loader"), threading.Thread(target=apply_update, name="trainer"),
               threading.Thread(target=save_snapshot, name="saver")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
