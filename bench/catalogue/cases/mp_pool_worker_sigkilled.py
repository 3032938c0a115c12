"""``multiprocessing.Pool.map`` whose worker was SIGKILLed mid-task, as the OOM killer does:
``crunch_shard`` blows up on shard 3 (simulated by the worker sending itself SIGKILL). The
pool replaces the dead worker, but the task it was running is lost; ``map`` waits for its
result forever.

Reports: python/cpython#96062 ("multiprocessing.Pool gets stuck indefinitely when the child
process is killed manually"); uqfoundation/pathos#230 ("Subprocess killed by OOM killer
leaves the script hanging forever"); mapillary/OpenSfM#190.
"""

import multiprocessing as mp
import os
import signal

CASE = {
    "title": "Pool.map whose worker was SIGKILLed mid-task (OOM-killer style)",
    "source": "python/cpython#96062; uqfoundation/pathos#230 (a killed worker's task is lost)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["ForkPoolWorker-1", "crunch_shard"],
    "cause": r"killed|SIGKILL|signal 9|died|is gone",
    "hangs_after": 1,
}


def crunch_shard(i: int) -> int:
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does to a worker that grew too big
    return i * i


def main() -> None:
    with mp.get_context("fork").Pool(1) as pool:
        print(pool.map(crunch_shard, range(6), chunksize=1))


if __name__ == "__main__":
    main()
