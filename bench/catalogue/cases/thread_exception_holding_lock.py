"""A thread died of an exception while holding a lock: ``load_manifest`` (thread loader) takes
the index lock with ``acquire()``, parses a manifest that is malformed, and the ValueError
ends the thread before its ``release()``. The main thread then waits for the lock forever
(the traceback went to stderr, long before anyone looked).

Report: Maluuba/nlg-eval#25 ("module was hanging when exception occurred in one thread while
others were waiting on lock").
"""

import json
import threading

CASE = {
    "title": "thread killed by an exception while holding a lock",
    "source": "Maluuba/nlg-eval#25 (an exception in one thread while others wait on its lock)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["loader", "load_manifest"],
    "cause": r"exited|died|raised|exception|is gone|never releas",
    "hangs_after": 0.5,
}

index_lock = threading.Lock()
index: dict[str, int] = {}


def load_manifest(text: str) -> None:
    index_lock.acquire()
    index.update(json.loads(text))  # raises: the manifest is cut short
    index_lock.release()


def main() -> None:
    t = threading.Thread(target=load_manifest, args=('{"shard-0": 1, "shard-1"',), name="loader")
    t.start()
    t.join()
    with index_lock:
        print(len(index))


if __name__ == "__main__":
    main()
