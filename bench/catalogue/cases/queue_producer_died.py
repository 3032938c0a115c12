"""``queue.Queue.get()`` whose only producer is dead: ``read_records`` (thread reader) puts a
few records, then a malformed line raises and ends the thread, without the end-of-stream
sentinel. The training loop beats once per record, then waits in ``get()`` forever.

Reports: aosabook/500lines#288 ("Crawler stuck on queue.get()": an exception in the
producing task vanished, the consumer waits on the queue); ray-project/ray#62998 ("Consumer
hangs forever after producer thread terminates").
"""

import queue
import threading
import time

import hangwatchd

CASE = {
    "title": "Queue.get whose only producer thread died",
    "source": "aosabook/500lines#288; ray-project/ray#62998 (the producer is gone, the consumer waits)",
    "healthy": False,
    "watch": {"heartbeat_timeout": 3},
    "ranks": 1,
    "culprit": ["reader", "read_records"],
    "cause": r"exited|died|raised|exception|is gone|nobody|never put",
    "hangs_after": 1,
}

records: "queue.Queue[str | None]" = queue.Queue()
LINES = ["a,1", "b,2", "c,3", "d,4", "e"]


def read_records() -> None:
    for line in LINES:
        key, value = line.split(",")  # the last line has no comma: ValueError ends the thread
        records.put(f"{key}={value}")
        time.sleep(0.2)
    records.put(None)


def main() -> None:
    threading.Thread(target=read_records, name="reader").start()
    while records.get() is not None:
        hangwatchd.beat()


if __name__ == "__main__":
    main()
