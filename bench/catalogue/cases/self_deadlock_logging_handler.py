"""A logging handler deadlocks on itself: ``ShippingHandler.emit`` holds its own buffer lock
(a plain Lock, not the handler's RLock) and, when the buffer is full, ``_flush_locked`` logs a
warning through the same logger, which calls ``emit`` again on the same thread, which waits
for the buffer lock it holds.

Reports: itamarst/crochet#25 ("Deadlock due to __del__() and ThreadLogObserver queue": a log
call made while the thread already holds the observer's queue lock); Delgan/loguru#720 (a
sink that logs while the handler's lock is held).
"""

import logging
import threading

CASE = {
    "title": "self-deadlock through a logging handler that logs",
    "source": "itamarst/crochet#25; Delgan/loguru#720 (logging re-entered while its lock is held)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["_flush_locked", "emit"],
    "cause": r"deadlock|itself|already hold|re-?enter",
    "hangs_after": 0.5,
}

log = logging.getLogger("trainer")


class ShippingHandler(logging.Handler):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._buffer_lock = threading.Lock()
        self._buffer: list[str] = []
        self._capacity = capacity

    def emit(self, record: logging.LogRecord) -> None:
        with self._buffer_lock:
            self._buffer.append(self.format(record))
            if len(self._buffer) >= self._capacity:
                self._flush_locked()

    def _flush_locked(self) -> None:
        log.warning("log buffer full (%d records), shipping", len(self._buffer))  # back into emit
        self._buffer.clear()


def main() -> None:
    log.addHandler(ShippingHandler(capacity=3))
    log.setLevel(logging.INFO)
    for step in range(5):
        log.info("step %d", step)


if __name__ == "__main__":
    main()
