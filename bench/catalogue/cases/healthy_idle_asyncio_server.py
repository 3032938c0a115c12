"""Healthy look-alike: an asyncio server with no clients. The loop waits in ``select`` inside
``serve_forever`` for as long as nobody connects.

Report: vllm-project/vllm#39863 (an API server that answers health checks while idle must not
be confused with one whose engine is dead).
"""

import asyncio

CASE = {
    "title": "idle asyncio server (serve_forever, no clients)",
    "source": "vllm-project/vllm#39863 (an idle API server is not a hung one)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(await reader.readline())
    writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
