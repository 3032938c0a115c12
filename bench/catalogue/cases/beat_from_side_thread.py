"""A heartbeat sent from a side thread while the work loop hangs: thread ``heartbeat`` beats
every half second whatever the program does; the main loop ``dispatch`` waits for the
routing lock, which thread ``flusher`` took and never released (it returned early, before its
``release()``). The beats keep coming, so only the stack can tell: a beat proves that its own
thread turns, not the one that waits.

Report: ChronoAIProject/consensus-rnd#143 (a daemon's heartbeat written by a sidecar; the
dispatch loop hung for 11 minutes while the heartbeat stayed fresh).
"""

import threading
import time

import hangwatchd

CASE = {
    "title": "a side thread beats while the main loop waits for a lock a gone thread kept",
    "source": "ChronoAIProject/consensus-rnd#143 (a sidecar heartbeat that lies)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["flusher", "flush_routes"],
    "cause": r"exited|is gone|died|never releas",
    "hangs_after": 1,
}

routing_lock = threading.Lock()
pending: list[str] = []


def beat_forever() -> None:
    while True:
        hangwatchd.beat()
        time.sleep(0.5)


def flush_routes() -> None:
    routing_lock.acquire()
    if not pending:
        return  # nothing to flush: the release below is never reached
    pending.clear()
    routing_lock.release()


def dispatch() -> None:
    for step in range(1_000_000):
        if step == 2:
            t = threading.Thread(target=flush_routes, name="flusher")
            t.start()
            t.join()
        with routing_lock:  # from step 2 on: held by a thread that no longer exists
            pending.append(f"route {step}")
            pending.clear()  # routed at once: nothing is left for the flusher
        time.sleep(0.3)


if __name__ == "__main__":
    threading.Thread(target=beat_forever, name="heartbeat", daemon=True).start()
    dispatch()
