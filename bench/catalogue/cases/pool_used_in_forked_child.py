"""A ``multiprocessing.Pool`` used in a forked child: the parent built the pool (and its
handler threads) and used it; then it forks a child (``score_in_child``) that calls
``pool.map`` on its copy of the pool. Threads do not survive a fork: the copy's task handler
and result handler threads do not exist in the child, so the tasks are queued and never sent,
and ``map`` waits forever. The parent waits for the child.

Reports: materialsproject/maggma#29 ("any threads in the parent process are now missing in
the forked copy. If your library starts some threads in the background your library will be
broken in the subprocess"); python/cpython#70015 (mixing a Pool and forking children hangs).
"""

import multiprocessing as mp
import os

CASE = {
    "title": "multiprocessing Pool used after fork in a child",
    "source": "materialsproject/maggma#29; python/cpython#70015 (a pool's threads do not survive fork)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["score_in_child"],
    "cause": r"fork|never started|is gone|does not exist|no (handler|thread)",
    "hangs_after": 1.5,
}


def square(x: int) -> int:
    return x * x


def score_in_child(pool: "mp.pool.Pool") -> None:
    print(pool.map(square, range(8)))  # nothing in this process hands the tasks to the workers
    os._exit(0)


def main() -> None:
    mp.set_start_method("fork")
    pool = mp.Pool(2)
    print(pool.map(square, range(4)))
    pid = os.fork()
    if pid == 0:
        score_in_child(pool)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
