"""A chain of waits whose root is a read nobody will answer: the main thread joins the
coordinator thread, which joins the fetcher thread, which reads its configuration from a pipe
whose write end this process holds and never writes to (the writer was to be a helper that
was never started). Three frames wait; only the last one says why.

Report: psf/requests#3353 ("get request hangs in readinto ... self._sock.recv_into(b) without
raising"): the wait several calls down a chain of joins and reads.
"""

import os
import threading

CASE = {
    "title": "join chain (3 hops) ending in a read of a pipe nobody writes",
    "source": "psf/requests#3353 (a blocking read at the bottom of a chain of waits)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["fetcher", "fetch_config"],
    "cause": r"read|pipe|nobody writes|never writes",
    "hangs_after": 0.5,
}

config_r, config_w = os.pipe()  # the write end stays open here and is never written


def fetch_config() -> bytes:
    return os.read(config_r, 4096)


def run_coordinator() -> None:
    fetcher = threading.Thread(target=fetch_config, name="fetcher")
    fetcher.start()
    fetcher.join()


def main() -> None:
    coordinator = threading.Thread(target=run_coordinator, name="coordinator")
    coordinator.start()
    coordinator.join()


if __name__ == "__main__":
    main()
