"""One thread takes a non-reentrant ``threading.Lock`` it already holds: ``register`` holds
the registry lock and calls ``_evict`` to make room, which takes the same lock again. The
thread waits for itself, forever; no other thread is involved.

Report: python/cpython#151482 (ThreadPoolExecutor's ``_shutdown_lock`` is a plain Lock: a
signal handler that shuts the executor down while ``submit()`` holds it deadlocks the main
thread on itself).
"""

import threading

CASE = {
    "title": "self-deadlock on a non-reentrant Lock",
    "source": "python/cpython#151482 (a plain Lock taken again by the thread that holds it)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["_evict", "register"],
    "cause": r"deadlock|itself|already hold",
    "hangs_after": 0.5,
}


class Registry:
    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, object] = {}
        self._capacity = capacity

    def register(self, key: str, value: object) -> None:
        with self._lock:
            if len(self._items) >= self._capacity:
                self._evict()
            self._items[key] = value

    def _evict(self) -> None:
        with self._lock:  # already held by register, two frames up
            self._items.pop(next(iter(self._items)))


def main() -> None:
    reg = Registry(capacity=2)
    for i in range(3):
        reg.register(f"model-{i}", object())


if __name__ == "__main__":
    main()
