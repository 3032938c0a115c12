"""A coroutine blocks the event loop with ``time.sleep``: ``refresh_token`` waits for a token's
expiry with ``time.sleep`` instead of ``await asyncio.sleep``; every other task of the loop
(here the request handlers) stops with it, for as long as it sleeps (an hour).

Reports: aio-libs/aiohttp#3630 ("time.sleep() blocks the entire application, not just the
current request"); warestack/watchflow#68 ("blocking time.sleep() in async retry path freezes
event loop").
"""

import asyncio
import time

CASE = {
    "title": "time.sleep inside a coroutine blocks the event loop",
    "source": "aio-libs/aiohttp#3630; warestack/watchflow#68 (time.sleep in async code)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["refresh_token"],
    "cause": r"sleep",
    "hangs_after": 0.5,
}


async def refresh_token() -> None:
    time.sleep(3600)  # should be: await asyncio.sleep(3600)


async def handle_requests() -> None:
    while True:
        await asyncio.sleep(0.1)


async def main() -> None:
    await asyncio.gather(handle_requests(), refresh_token())


if __name__ == "__main__":
    asyncio.run(main())
