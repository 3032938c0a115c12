"""A training loop fed by two multiprocessing workers (see loader.py); one worker's shard never arrives.

    python train.py SHARD_DIR     (prints READY PID1 PID2 once both workers run)
"""

import multiprocessing as mp
import os
import sys

import loader


def next_batch(results: "mp.Queue[int]") -> int:
    return results.get()


def train(shard_dir: str) -> None:
    paths: "mp.Queue[str]" = mp.Queue()
    results: "mp.Queue[int]" = mp.Queue()
    workers = [mp.Process(target=loader.worker_loop, args=(i, paths, results), name=f"worker-{i}") for i in range(2)]
    for w in workers:
        w.start()
    print("READY", *[w.pid for w in workers], flush=True)
    paths.put(os.path.join(shard_dir, "shard-0042"))
    for step in range(1_000_000):
        next_batch(results)


if __name__ == "__main__":
    mp.set_start_method("fork")
    train(sys.argv[1])
