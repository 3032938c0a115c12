"""Joining a process before reading its queue: the child (``compute_embeddings``) puts a 1 MiB
result on a ``multiprocessing.Queue`` and exits; but a process that put data on a queue does
not end until its feeder thread has flushed it into the pipe, and the pipe holds 64 KiB. The
parent (``collect``) calls ``join()`` before ``get()``: the child waits for the parent to read,
the parent waits for the child to end.

Reports: python/cpython#91594 and #73983 ("Deadlock with multiprocessing.Queue()": "if you try
joining that process you may get a deadlock unless you are sure that all items which have
been put on the queue have been consumed"); n8n-io/n8n#19084 (unresponsive at 64 KB).
"""

import multiprocessing as mp

CASE = {
    "title": "join() a child before get() of the queue it filled",
    "source": "python/cpython#91594, #73983; n8n-io/n8n#19084 (a queue's feeder thread holds the child)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["collect", "compute_embeddings"],
    "cause": r"deadlock|flush|full|pipe",
    "hangs_after": 1.5,
}


def compute_embeddings(out: "mp.Queue[bytes]") -> None:
    out.put(b"\0" * (1 << 20))


def collect() -> bytes:
    ctx = mp.get_context("fork")
    out: "mp.Queue[bytes]" = ctx.Queue()
    child = ctx.Process(target=compute_embeddings, args=(out,), name="embedder")
    child.start()
    child.join()  # before out.get(): the child cannot end until its 1 MiB is read
    return out.get()


if __name__ == "__main__":
    collect()
