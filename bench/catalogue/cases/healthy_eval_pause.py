"""Healthy look-alike: an evaluation pause. The main thread waits in ``run_eval`` for a thread
pool of 2 evaluators to score 20 shards, one shard finishing every few seconds; the main stack
is the same ``wait`` for the whole minute, but work completes all along.

Report: pytorch/pytorch#54059 (validation on part of the job while the rest waits: a pause, not
a hang, until it ends).
"""

import time
from concurrent.futures import ThreadPoolExecutor, wait

CASE = {
    "title": "eval pause: main waits on a pool that finishes a shard every few seconds",
    "source": "pytorch/pytorch#54059 (an evaluation pause is not a hang)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}


def score_shard(i: int) -> float:
    time.sleep(3.0 + (i % 3))  # waiting on a scoring service
    return i / 20


def run_eval() -> list[float]:
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="evaluator") as pool:
        futures = [pool.submit(score_shard, i) for i in range(20)]
        wait(futures)
        return [f.result() for f in futures]


if __name__ == "__main__":
    run_eval()
