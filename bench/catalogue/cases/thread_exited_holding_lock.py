"""A thread returned without releasing a lock: ``flush_once`` (thread flusher) takes the
journal lock with a bare ``acquire()`` and returns early when there is nothing to write,
skipping the ``release()`` at the bottom. The thread is gone; the lock stays held by nobody
alive, and the main thread waits for it forever.

Report: Minestom/Minestom#2013 ("Acquirable#sync would never release the acquired lock if the
consumer threw"; the early-exit path that skips the unlock).
"""

import threading

CASE = {
    "title": "thread exited while holding a lock",
    "source": "Minestom/Minestom#2013 (an exit path that skips the unlock)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["flusher", "flush_once"],
    "cause": r"exited|is gone|died|never releas",
    "hangs_after": 0.5,
}

journal_lock = threading.Lock()
pending: list[bytes] = []


def flush_once() -> None:
    journal_lock.acquire()
    if not pending:
        return  # nothing to write: the release below is never reached
    pending.clear()
    journal_lock.release()


def main() -> None:
    t = threading.Thread(target=flush_once, name="flusher")
    t.start()
    t.join()
    with journal_lock:  # held by a thread that no longer exists
        pending.append(b"epoch 1 done")


if __name__ == "__main__":
    main()
