"""A data-loader worker blocked in a read: two worker processes read shards and put samples
on a result queue; worker 1's next shard is a FIFO (a network mount that stopped answering
looks the same from the process) that nothing writes, so ``read_shard`` blocks in ``read()``.
The training loop, which beat once per batch, waits on the result queue; worker 0 waits for
work.

Reports: pytorch/pytorch#75147 ("Dataloader hangs"); RolnickLab/ami-data-companion#140
("DataLoader subprocess deadlock: MainThread hangs forever on queue.get").
"""

import multiprocessing as mp
import os
import tempfile

import hangwatchd

CASE = {
    "title": "loader worker process blocked reading a FIFO; the parent waits on its queue",
    "source": "pytorch/pytorch#75147; RolnickLab/ami-data-companion#140 (the loop waits on a stuck worker)",
    "healthy": False,
    "watch": {"heartbeat_timeout": 3},
    "ranks": 1,
    "culprit": ["read_shard", "loader-1"],
    "cause": r"read|FIFO",
    "hangs_after": 1,
}


def read_shard(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def load(shards: "mp.Queue[str | None]", results: "mp.Queue[int]") -> None:
    while (path := shards.get()) is not None:
        results.put(len(read_shard(path)))


def main() -> None:
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i in range(4):
            p = os.path.join(d, f"shard-{i:04d}")
            with open(p, "wb") as f:
                f.write(b"x" * (100 + i))
            paths.append(p)
        stuck = os.path.join(d, "shard-0042")
        os.mkfifo(stuck)
        keep = os.open(stuck, os.O_RDWR | os.O_NONBLOCK)  # a writer that never writes: open succeeds, read blocks
        queues = [ctx.Queue(), ctx.Queue()]
        results: "mp.Queue[int]" = ctx.Queue()
        workers = [ctx.Process(target=load, args=(queues[i], results), name=f"loader-{i}") for i in range(2)]
        for w in workers:
            w.start()
        for i, p in enumerate(paths):
            queues[i % 2].put(p)
        queues[1].put(stuck)
        for _ in range(len(paths) + 1):
            results.get()
            hangwatchd.beat()
        os.close(keep)


if __name__ == "__main__":
    main()
