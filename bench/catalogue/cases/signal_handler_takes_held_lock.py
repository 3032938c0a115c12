"""A signal handler that takes a lock its own thread holds: the main loop writes its journal
through ``write_line``, which holds ``journal_lock`` while it flushes (slowly). A helper
child exits; ``SIGCHLD`` arrives while main is inside ``write_line``; Python runs
``on_sigchld`` on the main thread, on top of the interrupted frame, and the handler logs
"reaped ..." through ``write_line`` too: it waits for a lock that the frame beneath it holds
and will never release. One thread, deadlocked with itself through a signal.

Report: patroni/patroni#3413 ("Fix signal handler reentrancy deadlock caused by logging": a
SIGCHLD handler logs while the interrupted thread holds the logging queue's lock).
"""

import os
import signal
import threading
import time

CASE = {
    "title": "SIGCHLD handler takes the journal lock the interrupted main loop holds",
    "source": "patroni/patroni#3413 (a signal handler logs while its thread holds the log lock)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["on_sigchld"],
    "cause": r"re-?entered|signal handler",
    "hangs_after": 1,
}

journal_lock = threading.Lock()
journal: list[str] = []
helper_alive = False


def write_line(msg: str) -> None:
    with journal_lock:
        time.sleep(0.05)  # a slow flush, under the lock
        journal.append(msg)


def on_sigchld(signum: int, frame: object) -> None:
    global helper_alive
    pid, status = os.waitpid(-1, os.WNOHANG)
    helper_alive = False
    write_line(f"reaped helper {pid} (status {status})")  # the interrupted frame holds journal_lock


def start_helper() -> None:
    global helper_alive
    helper_alive = True
    if os.fork() == 0:
        time.sleep(0.3)
        os._exit(0)


def main() -> None:
    signal.signal(signal.SIGCHLD, on_sigchld)
    step = 0
    while True:
        if not helper_alive:
            start_helper()
        write_line(f"step {step}")
        step += 1


if __name__ == "__main__":
    main()
