"""A data-loader worker that died: worker 1 is killed with SIGKILL (the OOM killer's way) while
it decodes a large sample in ``load_sample``; nothing tells the parent, whose training loop
(beating once per batch) waits on the result queue for a batch that will never come.

Reports: pytorch/pytorch#21554 ("Pytorch hangs when dataloader multiprocessing workers are
killed"); abacusorg/abacusutils#150 ("multiprocessing parent process doesn't get notified if
child process dies").
"""

import multiprocessing as mp
import os
import signal

import hangwatchd

CASE = {
    "title": "loader worker process killed (SIGKILL); the parent waits on its queue",
    "source": "pytorch/pytorch#21554; abacusorg/abacusutils#150 (a dead worker, a parent that waits)",
    "healthy": False,
    "watch": {"heartbeat_timeout": 3},
    "ranks": 1,
    "culprit": ["loader-1", "load_sample"],
    "cause": r"killed|SIGKILL|signal 9|died|is gone",
    "hangs_after": 1,
}

HUGE = 7


def load_sample(i: int) -> int:
    if i == HUGE:
        os.kill(os.getpid(), signal.SIGKILL)  # the sample that does not fit in memory
    return i


def load(indices: "mp.Queue[int | None]", results: "mp.Queue[int]") -> None:
    while (i := indices.get()) is not None:
        results.put(load_sample(i))


def main() -> None:
    ctx = mp.get_context("fork")
    indices = [ctx.Queue(), ctx.Queue()]
    results: "mp.Queue[int]" = ctx.Queue()
    workers = [ctx.Process(target=load, args=(indices[w], results), name=f"loader-{w}") for w in range(2)]
    for w in workers:
        w.start()
    for i in range(10):
        indices[i % 2].put(i)
    for _ in range(10):
        results.get()
        hangwatchd.beat()


if __name__ == "__main__":
    main()
