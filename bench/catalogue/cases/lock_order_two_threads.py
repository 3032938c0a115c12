"""Two threads take the same two locks in opposite orders: a classic lock-order deadlock.

``update_cache`` (thread cache-writer) holds the cache lock and wants the stats lock;
``report_stats`` (thread stats-reporter) holds the stats lock and wants the cache lock. A
barrier makes both take their first lock before either asks for its second, so it hangs
every time. The main thread only joins.

Report: python/cpython#106883, "Deadlock in threaded application when using
sys._current_frames": one thread holds the GIL and waits for the interpreters mutex, another
holds that mutex and waits for the GIL.
"""

import threading

CASE = {
    "title": "lock-order deadlock, 2 threads",
    "source": "python/cpython#106883 (two locks taken in opposite orders by two threads)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["update_cache", "report_stats", "cache-writer", "stats-reporter"],
    "cause": r"deadlock",
    "hangs_after": 1,
}

cache_lock = threading.Lock()
stats_lock = threading.Lock()
both_hold_one = threading.Barrier(2)


def update_cache() -> None:
    with cache_lock:
        both_hold_one.wait()
        with stats_lock:
            pass


def report_stats() -> None:
    with stats_lock:
        both_hold_one.wait()
        with cache_lock:
            pass


def main() -> None:
    threads = [threading.Thread(target=update_cache, name="cache-writer"),
               threading.Thread(target=report_stats, name="stats-reporter")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
