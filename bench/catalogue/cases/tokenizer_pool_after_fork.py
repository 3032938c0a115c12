"""A tokenizer thread pool used after fork: the serving process encodes a warm-up batch with
its ``ThreadPoolExecutor`` (4 threads start), then forks a worker process that encodes with
the same pool. In the child the pool's threads do not exist, yet the pool believes it has idle
workers, so it starts none: ``tokenize_in_worker`` waits on futures no thread will run. The
parent waits for the worker. (Hugging Face tokenizers print "The current process just got
forked, after parallelism has already been used. Disabling parallelism to avoid deadlocks"
for exactly this.)

Reports: huggingface/tokenizers#187 ("python version hangs on encode_batch when run in
subprocess": used once in the parent, frozen in a DataLoader worker); deepset-ai/haystack#7787.
"""

import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor

CASE = {
    "title": "tokenizer thread pool used in a forked worker",
    "source": "huggingface/tokenizers#187; deepset-ai/haystack#7787 (parallelism used before fork)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["tokenize_in_worker"],
    "cause": r"fork|never started|is gone|does not exist|no (worker|thread)",
    "hangs_after": 1.5,
}

pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenizer")


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def tokenize_in_worker(texts: list[str]) -> None:
    print([f.result() for f in [pool.submit(encode, t) for t in texts]])


def main() -> None:
    warm = [pool.submit(encode, t) for t in ["a", "bb", "ccc", "dddd"]]
    print([f.result() for f in warm])
    worker = mp.get_context("fork").Process(target=tokenize_in_worker, args=(["hello", "world"],), name="tokenizer-worker")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
