"""An ``asyncio.Lock`` held by a cancelled task: ``refresh_cache`` acquires the lock with a bare
``await lock.acquire()`` and releases it at the end without try/finally; a timeout cancels it
while it awaits the backend, so the release never runs. Every later ``async with lock`` (here
``serve``) waits forever, on an idle loop.

Reports: python/cpython#88157 ("asyncio lock does not get released after task is canceled");
ApeWorX/web3.py#2693 ("the lock will never be released by the task, and all future uses of
async_lock will hang").
"""

import asyncio

CASE = {
    "title": "asyncio.Lock held by a task that was cancelled",
    "source": "python/cpython#88157; ApeWorX/web3.py#2693 (cancelled while holding the lock)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["refresh_cache"],
    "cause": r"cancel|never releas",
    "hangs_after": 1,
}

lock = asyncio.Lock()


async def refresh_cache() -> None:
    await lock.acquire()
    await asyncio.sleep(10)  # the backend is slow
    lock.release()  # skipped when cancelled above


async def serve() -> None:
    async with lock:
        pass


async def main() -> None:
    try:
        await asyncio.wait_for(refresh_cache(), timeout=0.3)
    except asyncio.TimeoutError:
        pass
    await serve()


if __name__ == "__main__":
    asyncio.run(main())
