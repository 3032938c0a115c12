"""Healthy look-alike: a slow but moving data pipeline. Two worker processes each produce a
sample every 3 s (slow storage); the parent's ``next_sample`` waits in ``Queue.get`` nearly all
the time, the same stack sample after sample, but a sample arrives every 1.5 s.

Report: RolnickLab/ami-data-companion#140 (a parent in queue.get: hung, or just waiting for slow
workers?).
"""

import multiprocessing as mp
import time

CASE = {
    "title": "slow but moving data pipeline (workers produce every 3 s)",
    "source": "RolnickLab/ami-data-companion#140 (queue.get waits: slow is not stuck)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}


def produce(worker: int, out: "mp.Queue[int]") -> None:
    time.sleep(1.5 * worker)
    i = 0
    while True:
        time.sleep(3.0)
        out.put(i)
        i += 1


def next_sample(q: "mp.Queue[int]") -> int:
    return q.get()


def main() -> None:
    ctx = mp.get_context("fork")
    q: "mp.Queue[int]" = ctx.Queue()
    for w in range(2):
        ctx.Process(target=produce, args=(w, q), name=f"slow-worker-{w}", daemon=True).start()
    while True:
        next_sample(q)


if __name__ == "__main__":
    main()
