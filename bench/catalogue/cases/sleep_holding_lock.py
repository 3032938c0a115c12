"""A thread sleeps while it holds a lock others need: ``save_state`` (thread checkpointer)
holds the state lock across a ``time.sleep`` meant to wait for remote storage to settle (an
hour, from a mis-read config value in seconds instead of milliseconds). The main thread's
next step waits for the lock.

Report: jalantechnologies/flask-react-template#30 ("Fix deadlocks in HTTP server": a
handler that sleeps 60 s holds the only worker, every other request waits behind it).
"""

import threading
import time

CASE = {
    "title": "time.sleep in a thread that holds a lock",
    "source": "jalantechnologies/flask-react-template#30 (a sleeping holder blocks everyone behind it)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["save_state", "checkpointer"],
    "cause": r"sleep",
    "hangs_after": 0.5,
}

state_lock = threading.Lock()
SETTLE_S = 3600.0  # meant to be 3600 ms


def save_state() -> None:
    with state_lock:
        time.sleep(SETTLE_S)


def train_step() -> None:
    with state_lock:
        pass


def main() -> None:
    threading.Thread(target=save_state, name="checkpointer").start()
    time.sleep(0.2)
    train_step()


if __name__ == "__main__":
    main()
