"""ThreadPoolExecutor starvation: ``prepare_batch`` runs on the pool's only worker and submits
``tokenize`` to the same pool, then waits for its result. The subtask is queued behind the
task that waits for it; no worker will ever be free to run it.

Report: langchain-ai/langchain#10638 (nested ``executor.submit(...).result()`` in a pool of
max_concurrency=1 deadlocks); bshoshany/thread-pool#95 ("Deadlock with nested loops").
"""

from concurrent.futures import ThreadPoolExecutor

CASE = {
    "title": "thread pool starvation (task waits on a task queued behind it)",
    "source": "langchain-ai/langchain#10638; bshoshany/thread-pool#95 (nested submit in a full pool)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["prepare_batch"],
    "cause": r"deadlock|starv|queued behind|no (free|idle) worker|itself",
    "hangs_after": 0.5,
}

pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prep")


def tokenize(text: str) -> list[str]:
    return text.split()


def prepare_batch(text: str) -> list[str]:
    return pool.submit(tokenize, text).result()  # queued behind this very task


def main() -> None:
    print(pool.submit(prepare_batch, "the quick brown fox").result())


if __name__ == "__main__":
    main()
