"""ProcessPoolExecutor with ``max_tasks_per_child``: its only worker exits after 2 tasks, as it
should, but the executor never starts a replacement (a stale idle-worker token says one is
idle), so the 8 tasks left in its queue never run and ``result()`` waits forever. Present in
Python 3.11 to 3.14.

Report: python/cpython#115634 / PR #140900 ("Fix ProcessPoolExecutor deadlock with
max_tasks_per_child": "Prints 0 and 1, then hangs forever").
"""

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

CASE = {
    "title": "ProcessPoolExecutor worker retired by max_tasks_per_child, never replaced",
    "source": "python/cpython#115634 (PR #140900: 'Prints 0 and 1, then hangs forever')",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["SpawnProcess-1", "max_tasks_per_child"],
    "cause": r"exited|is gone|never (replaced|spawned|started)|no worker",
    "hangs_after": 1,
}


def shard_len(i: int) -> int:
    return i * 10


def main() -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), max_tasks_per_child=2) as ex:
        futures = [ex.submit(shard_len, i) for i in range(10)]
        print([f.result() for f in futures])


if __name__ == "__main__":
    main()
