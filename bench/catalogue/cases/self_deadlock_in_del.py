"""A finalizer takes a lock its own thread already holds: ``adopt`` holds the handle table's
lock while it replaces an old ``Handle``; dropping the last reference runs ``Handle.__del__``
right there, on the same thread, and ``__del__`` calls ``release``, which waits for the table
lock. A non-reentrant lock and a finalizer: the thread waits for itself.

Reports: ray-project/ray#60011 ("Fix deadlock in garbage collection when holding lock":
``ClientObjectRef.__del__`` takes the DataClient lock the thread already holds);
wandb/wandb#11402 (a ``__del__`` that prints while the console lock is held).
"""

import threading

CASE = {
    "title": "self-deadlock in __del__ while the lock is held",
    "source": "ray-project/ray#60011; wandb/wandb#11402 (a finalizer runs on the thread that holds the lock)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["release", "__del__", "adopt"],
    "cause": r"deadlock|itself|already hold|finali[sz]er|__del__",
    "hangs_after": 0.5,
}

_table_lock = threading.Lock()
_handles: dict[str, "Handle"] = {}


class Handle:
    def __init__(self, key: str) -> None:
        self.key = key

    def __del__(self) -> None:
        release(self.key)


def release(key: str) -> None:
    with _table_lock:
        _handles.pop(key + ".lease", None)


def adopt(key: str) -> None:
    with _table_lock:
        _handles[key] = Handle(key)  # the handle it replaces is freed here, lock held


def main() -> None:
    adopt("shard-7")
    adopt("shard-7")


if __name__ == "__main__":
    main()
