"""A training loop fed by two multiprocessing workers (loader.py); shard 42 is a FIFO nobody writes.

    python train.py SHARD_DIR     (prints READY once it asks for shard 42)
"""

import multiprocessing as mp
import os
import sys

import hangwatchd
import loader


def next_batch(results: "mp.Queue[int]") -> int:
    return results.get()


def train(shard_dir: str) -> None:
    paths: "mp.Queue[str]" = mp.Queue()
    results: "mp.Queue[int]" = mp.Queue()
    workers = [mp.Process(target=loader.worker_loop, args=(i, paths, results)) for i in range(2)]
    for w in workers:
        w.start()
    for step in range(30):
        paths.put(os.path.join(shard_dir, f"shard-{step % 3:04d}"))
        next_batch(results)
        hangwatchd.beat()
    paths.put(os.path.join(shard_dir, "shard-0042"))
    print("READY", flush=True)
    next_batch(results)


if __name__ == "__main__":
    mp.set_start_method("fork")
    train(sys.argv[1])
