"""``asyncio.Queue.get`` with no producer left: ``produce_pages`` raises on a malformed page and
its task ends (the exception is stored in the task, nobody awaits it); ``consume`` beat once
per page and now awaits the queue forever on an idle loop.

Reports: aosabook/500lines#288 ("Crawler stuck on async queue.get()": "why the uncaught
Exception just disappeared ... the program just looks like stucked"); tornadoweb/tornado#2951.
"""

import asyncio

import hangwatchd

CASE = {
    "title": "asyncio.Queue.get whose producer task died",
    "source": "aosabook/500lines#288; tornadoweb/tornado#2951 (the producer task is gone)",
    "healthy": False,
    "watch": {"heartbeat_timeout": 3},
    "ranks": 1,
    "culprit": ["produce_pages"],
    "cause": r"exited|died|raised|exception|is gone|nobody|never put",
    "hangs_after": 1,
}

PAGES = ["<p>1</p>", "<p>2</p>", "<p>3</p>", None, "<p>5</p>"]


async def produce_pages(q: "asyncio.Queue[str]") -> None:
    for page in PAGES:
        await asyncio.sleep(0.2)
        await q.put(page.upper())  # the None page raises AttributeError: the task ends here


async def consume(q: "asyncio.Queue[str]") -> None:
    while True:
        await q.get()
        hangwatchd.beat()


async def main() -> None:
    q: "asyncio.Queue[str]" = asyncio.Queue()
    producer = asyncio.create_task(produce_pages(q))
    await consume(q)
    await producer


if __name__ == "__main__":
    asyncio.run(main())
