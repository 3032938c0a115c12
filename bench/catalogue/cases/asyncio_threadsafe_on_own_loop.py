"""A coroutine waits on its own event loop: ``load_settings`` (sync code called from a
coroutine) submits a coroutine to the running loop with ``run_coroutine_threadsafe`` and
blocks on ``.result()``; the loop cannot run the submitted coroutine while it is blocked in
that very call.

Reports: empicano/aiomqtt#174 ("When called from self._loop, the following code will deadlock:
run_coroutine_threadsafe(...) ... fut.result()"); python/cpython#121075; tschamm/boschshc-hass#297.
"""

import asyncio

CASE = {
    "title": "run_coroutine_threadsafe(...).result() on the loop's own thread",
    "source": "empicano/aiomqtt#174; python/cpython#121075 (waiting on the loop from inside it)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["load_settings"],
    "cause": r"deadlock|itself|own (event )?loop|same (thread|loop)",
    "hangs_after": 0.5,
}


async def read_settings() -> dict[str, int]:
    return {"batch": 8}


def load_settings(loop: asyncio.AbstractEventLoop) -> dict[str, int]:
    return asyncio.run_coroutine_threadsafe(read_settings(), loop).result()


async def main() -> None:
    print(load_settings(asyncio.get_running_loop()))


if __name__ == "__main__":
    asyncio.run(main())
