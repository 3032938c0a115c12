"""An asyncio future nobody will resolve: ``await_reply`` registers a future under the request
id and awaits it; the reader that resolves futures drops the reply because it was keyed by a
different id (the request was re-numbered on retry). The event loop is idle, the task waits
forever.

Reports: ApeWorX/web3.py#2693 ("all future uses of async_lock will hang" after a future is left
pending); python/cpython#121075 (a future that nothing completes; .result() waits).
"""

import asyncio

CASE = {
    "title": "asyncio task awaits a future nobody resolves",
    "source": "ApeWorX/web3.py#2693; python/cpython#121075 (a pending future nothing completes)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["await_reply"],
    "cause": r"nobody|never (be )?(set|resolv|complet)",
    "hangs_after": 0.5,
}

pending: dict[int, "asyncio.Future[bytes]"] = {}


async def deliver(request_id: int, reply: bytes) -> None:
    fut = pending.get(request_id)
    if fut is not None:
        fut.set_result(reply)


async def await_reply(request_id: int) -> bytes:
    fut: "asyncio.Future[bytes]" = asyncio.get_running_loop().create_future()
    pending[request_id] = fut
    await deliver(request_id + 1000, b"pong")  # the reply comes back under the retried id
    return await fut


if __name__ == "__main__":
    asyncio.run(await_reply(7))
