"""Import-lock deadlock: the script loads itself as a plugin module. The module's import-time
code starts a ``warmup`` thread (``warm_cache``) and joins it before the import finishes.
``warm_cache`` does a lazy ``import`` of that same plugin module, which is still being
initialised by the main thread: it waits on the module's import lock, which the main thread
holds until the import returns, and the main thread waits in ``join()`` for the thread.
Python's import deadlock detector only sees module locks, not the join, so nothing raises.

Reports: python/cpython#125037 ("Import system deadlocks in multithreading environments when
performing circular imports": a module starts and joins a thread that imports it);
cython/cython#2486 ("Late import in thread hangs").
"""

import importlib
import threading
from pathlib import Path

CASE = {
    "title": "module import starts and joins a thread that imports the same module",
    "source": "python/cpython#125037; cython/cython#2486 (a thread imports a module whose import joins it)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["warmup", "warm_cache"],
    "cause": r"import lock|importing|import of",
    "hangs_after": 0.5,
}

CACHE: dict[str, int] = {}


def warm_cache() -> None:
    plugin = importlib.import_module(__name__)  # the plugin is still being imported by main
    plugin.CACHE["ready"] = 1


if __name__ == "__main__":
    importlib.import_module(Path(__file__).stem)  # load this file as a plugin
else:
    # import-time code of the plugin: warm the cache before anyone uses it
    warmup = threading.Thread(target=warm_cache, name="warmup")
    warmup.start()
    warmup.join()
