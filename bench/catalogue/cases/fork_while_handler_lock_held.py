"""``os.fork()`` while another thread holds a lock: the log pump thread is inside
``ShippingHandler.emit``, holding the handler's own send lock while a slow send is in flight,
at the moment the main thread forks a worker. The child inherits the lock locked, but not the
thread that would release it; its first log line (``worker_main``) waits for the lock forever.
The parent waits for the child.

(Python re-creates the ``logging`` module's own locks after a fork; a handler's private lock
is not.)

Reports: DataDog/dd-trace-py#18900 ("The deadlock happens when a logging handler lock is held
by another thread at fork time. In the forked child, only the forking thread survives");
agronholm/pythonfutures#52 (bpo-6721: a lock held at fork is never released in the child).
"""

import logging
import os
import threading
import time

CASE = {
    "title": "fork while another thread holds a logging handler's lock",
    "source": "DataDog/dd-trace-py#18900; agronholm/pythonfutures#52 (bpo-6721, locks held across fork)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["worker_main", "log-pump"],
    "cause": r"fork|is gone|does not exist|never releas|exited",
    "hangs_after": 1.5,
}

log = logging.getLogger("pipeline")
sending = threading.Event()


class ShippingHandler(logging.Handler):
    """Sends each record to a collector; one send at a time, under its own lock."""

    def __init__(self) -> None:
        super().__init__()
        self._send_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._send_lock:
            sending.set()
            time.sleep(1.0)  # a slow network send


def pump_logs() -> None:
    while True:
        log.info("heartbeat")


def worker_main() -> None:
    log.info("worker %d started", os.getpid())  # waits for a lock held by a thread not in this process
    os._exit(0)


def main() -> None:
    log.addHandler(ShippingHandler())
    log.setLevel(logging.INFO)
    threading.Thread(target=pump_logs, name="log-pump", daemon=True).start()
    sending.wait()
    pid = os.fork()
    if pid == 0:
        worker_main()
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
