"""``asyncio.Event.set()`` called from a foreign thread: the service's ``main`` coroutine
awaits ``ready.wait()`` while a ``model-loader`` thread loads the model and then calls
``ready.set()`` directly, instead of through ``loop.call_soon_threadsafe``. ``set()`` queues
the waiter's wake-up on the loop, but nothing wakes the loop's ``epoll_wait`` (no timeout, no
other I/O): the thread has exited, the event is set, and the loop sleeps forever.

Reports: python/cpython#122938 ("Asyncio.Event.wait doesn't resume execution when the event is
set if no other tasks are active"); python/cpython#98955 (Event set from another thread: "in
py3.10, it freezes"); home-assistant/core#62418 (non-thread-safe event.set).
"""

import asyncio
import threading
import time

CASE = {
    "title": "asyncio.Event set from another thread; the loop is never woken",
    "source": "python/cpython#122938; python/cpython#98955 (asyncio.Event.set outside the loop's thread)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["model-loader", "load_model"],
    "cause": r"thread-?safe|call_soon_threadsafe|never woken",
    "hangs_after": 0.5,
}


def load_model(loop_ready: asyncio.Event) -> None:
    time.sleep(0.2)  # the model's weights
    loop_ready.set()  # not on the loop's thread: the loop is not woken


async def wait_until_ready(ready: asyncio.Event) -> None:
    await ready.wait()


async def main() -> None:
    ready = asyncio.Event()
    threading.Thread(target=load_model, args=(ready,), name="model-loader").start()
    await wait_until_ready(ready)
    print("serving")


if __name__ == "__main__":
    asyncio.run(main())
