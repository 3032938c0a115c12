"""A protocol deadlock across two processes: the client (``read_banner``) waits for the
server to greet first, the server child process (``read_request``) waits for the client to
send its request first. Each is in ``recv()`` on the same connection; neither will ever send.

Reports: shove70/async#1 ("client freezes, waiting for a response": the server waits for data
that never arrived); tinyproxy/tinyproxy#9 (recv blocked waiting for the other side's
headers).
"""

import os
import signal
import socket
import sys

CASE = {
    "title": "both ends of a connection wait to read first (2 processes)",
    "source": "shove70/async#1; tinyproxy/tinyproxy#9 (each side waits for the other to speak)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["read_banner", "read_request"],
    "cause": r"deadlock|each other|both|recv",
    "hangs_after": 1,
}


def read_request(server: socket.socket) -> bytes:
    conn, _ = server.accept()
    return conn.recv(4096)  # the server speaks only after the request


def read_banner(port: int) -> bytes:
    client = socket.create_connection(("127.0.0.1", port))
    return client.recv(64)  # the client speaks only after the banner


def main() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        read_request(server)
        os._exit(0)
    read_banner(server.getsockname()[1])
    os.waitpid(pid, 0)
    sys.exit(0)


if __name__ == "__main__":
    main()
