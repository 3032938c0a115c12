"""``recv()`` from a peer that never sends: the process's own status server (thread
status-server) accepts the connection and parks it in a list for a worker pool that was never
started; ``read_greeting`` then waits for a greeting that nothing will ever write. No timeout
on the socket.

Reports: websocket-client/websocket-client#48 ("data = self.sock.recv() causes hang": no
timeout on the read); orca-zhang/influxdb-cpp#52 ("Program hangs on recv()").
"""

import socket
import threading

CASE = {
    "title": "socket recv from a peer that accepted and never answers",
    "source": "websocket-client/websocket-client#48; orca-zhang/influxdb-cpp#52 (recv with no timeout)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["read_greeting"],
    "cause": r"recv|socket|never sends|nobody (sends|writes)",
    "hangs_after": 0.5,
}

parked: list[socket.socket] = []  # accepted connections, for workers that never start


def accept_once(server: socket.socket) -> None:
    conn, _ = server.accept()
    parked.append(conn)


def read_greeting(port: int) -> bytes:
    client = socket.create_connection(("127.0.0.1", port))
    return client.recv(64)


def main() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=accept_once, args=(server,), name="status-server").start()
    read_greeting(server.getsockname()[1])


if __name__ == "__main__":
    main()
