"""threading.Barrier with a party gone: main and three ``loader-N`` threads meet at a
``Barrier(4)`` once every shard is parsed. ``loader-2`` hits a corrupt record (``None``) in
``load_shard`` and dies of a ``TypeError`` before it reaches the barrier. Nobody calls
``abort()`` and the barrier has no timeout: main and the two healthy loaders wait for a
fourth party that no longer exists.

Reports: Quansight-Labs/free-threaded-compatibility#133 (barrier examples deadlock when a thread
errors before ``barrier.wait()``, seen in numpy's CI); Draegerwerk/SDCcc#188 ("Main thread hangs
at cyclic barrier from unhandled exception in a DatabaseInteractionThread").
"""

import threading

CASE = {
    "title": "threading.Barrier whose fourth party died before arriving",
    "source": "Quansight-Labs/free-threaded-compatibility#133; Draegerwerk/SDCcc#188 (a party dies before the barrier)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["loader-2", "load_shard"],
    "cause": r"died|exited|raised|exception|is gone|never (arrive|reach|came|call)",
    "hangs_after": 0.5,
}

SHARDS = [["1", "2", "3"], ["4", "5"], ["6", None, "8"]]
parsed = threading.Barrier(len(SHARDS) + 1)
totals: dict[int, int] = {}


def load_shard(index: int, records: list) -> None:
    totals[index] = sum(int(r) for r in records)  # int(None): TypeError in loader-2
    parsed.wait()


def main() -> None:
    loaders = [threading.Thread(target=load_shard, args=(i, s), name=f"loader-{i}") for i, s in enumerate(SHARDS)]
    for t in loaders:
        t.start()
    parsed.wait()  # main is the fourth party; loader-2 never comes
    for t in loaders:
        t.join()
    print(sum(totals.values()))


if __name__ == "__main__":
    main()
