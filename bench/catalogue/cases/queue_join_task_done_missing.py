"""``queue.Queue.join()`` that never returns: main puts five uploads on a work queue and
joins it. The ``uploader`` thread's ``upload_worker`` calls ``task_done()`` only on success;
when an item fails (a record without a key) it logs and ``continue``s, skipping
``task_done()``. The queue's unfinished count stays at 1; the worker sits idle in ``get()``
and main waits in ``join()`` forever.

Reports: dbt-labs/dbt-core#5602 ("Execution of job_queue.join hangs with exceptions");
RagnarGrootKoerkamp/BAPCtools#268 ("we don't call q.task_done() if an exception occurred ...
leads to infinite waits if q.join() is called").
"""

import queue
import threading

CASE = {
    "title": "Queue.join() after a worker skipped task_done() on a failed item",
    "source": "dbt-labs/dbt-core#5602; RagnarGrootKoerkamp/BAPCtools#268 (task_done skipped on the error path)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["uploader", "upload_worker"],
    "cause": r"task_done",
    "hangs_after": 0.5,
}

work: "queue.Queue[dict]" = queue.Queue()
uploaded: list[str] = []


def upload_worker() -> None:
    while True:
        item = work.get()
        try:
            uploaded.append(item["key"])
        except KeyError:
            print(f"skipping bad item {item}")
            continue  # the error path never calls task_done()
        work.task_done()


def main() -> None:
    threading.Thread(target=upload_worker, name="uploader", daemon=True).start()
    for item in [{"key": "a"}, {"key": "b"}, {"name": "c"}, {"key": "d"}, {"key": "e"}]:
        work.put(item)
    work.join()  # one task is never marked done
    print("uploaded", uploaded)


if __name__ == "__main__":
    main()
