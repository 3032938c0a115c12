"""A server nobody instrumented: threads cache and stats take two locks in opposite order and
deadlock; the main thread waits in join."""

import threading

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


def serve() -> None:
    threads = [threading.Thread(target=update_cache, name="cache"), threading.Thread(target=report_stats, name="stats")]
    for t in threads:
        t.start()
    print("READY", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    serve()
