"""A coroutine makes a blocking socket call inside the event loop: ``fetch_profile`` uses a
plain blocking socket (what a sync HTTP client does) to ask a backend that accepted the
connection and does not answer; the whole loop waits in ``recv()`` with it.

Reports: psf/requests#3353 (a blocking ``recv_into`` that never returns); aio-libs/aiohttp#3630
(a blocking call in a handler stops every request of the loop).
"""

import asyncio
import socket
import threading

CASE = {
    "title": "blocking socket recv inside a coroutine (loop blocked)",
    "source": "psf/requests#3353; aio-libs/aiohttp#3630 (sync I/O in async code)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["fetch_profile"],
    "cause": r"recv|socket|block",
    "hangs_after": 0.5,
}

accepted: list[socket.socket] = []


def silent_backend(server: socket.socket) -> None:
    conn, _ = server.accept()
    accepted.append(conn)  # keeps the connection, never answers


async def fetch_profile(port: int) -> bytes:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /profile HTTP/1.0\r\n\r\n")
    return sock.recv(4096)  # blocking, inside the event loop


async def heartbeat() -> None:
    while True:
        await asyncio.sleep(0.1)


async def main() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=silent_backend, args=(server,), name="backend", daemon=True).start()
    await asyncio.gather(heartbeat(), fetch_profile(server.getsockname()[1]))


if __name__ == "__main__":
    asyncio.run(main())
