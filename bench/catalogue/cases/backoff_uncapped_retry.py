"""An uncapped exponential backoff: ``upload_with_retry`` (thread uploader) fails to reach
the metrics endpoint (nothing listens there) and sleeps ``180 * 2 ** attempt`` seconds before
the next try, with no cap and no give-up; the main thread joins it at the end of the run. The
process is not deadlocked: it sleeps for 3 minutes, then 6, then 12... and looks hung.

Reports: UKGovernmentBEIS/inspect_ai#1753 ("Exponential backoff waits longer than 30
minutes": "retry 19 after waiting for 19288 s"); red-hat-storage/ocs-ci#11223 (backoff > 1
growing without a limit).
"""

import socket
import threading
import time

CASE = {
    "title": "uncapped exponential backoff (sleeps 180 s and more) that main joins",
    "source": "UKGovernmentBEIS/inspect_ai#1753; red-hat-storage/ocs-ci#11223 (backoff without a cap)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["upload_with_retry", "uploader"],
    "cause": r"sleep|backoff|retry",
    "hangs_after": 0.5,
}

FIRST_DELAY_S = 180.0  # the retry policy from the config file: initial 180 s, factor 2, no cap


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # bound, never listened on: connections are refused


def upload_with_retry(port: int) -> None:
    attempt = 0
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return
        except OSError:
            time.sleep(FIRST_DELAY_S * 2 ** attempt)
            attempt += 1


def main() -> None:
    uploader = threading.Thread(target=upload_with_retry, args=(closed_port(),), name="uploader")
    uploader.start()
    uploader.join()


if __name__ == "__main__":
    main()
