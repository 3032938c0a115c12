"""A single-threaded HTTP server that calls itself: the handler for ``/report``
(``fetch_metrics``) makes an HTTP request to ``/metrics`` on the same server, which is busy
serving ``/report`` and so never accepts it. The server thread waits on itself; the main
thread, the client of ``/report``, waits on the server.

Reports: bottlepy/bottle#757 ("Strange behavior when calling into self": wsgiref's server is
single-threaded, "calling into itself cannot work... a nice example for a deadlock");
blockchain-certificates/cert-viewer#68 ("anything which causes the server to connect to
itself will timeout").
"""

import http.server
import threading
import urllib.request

CASE = {
    "title": "single-threaded HTTP server whose handler requests itself",
    "source": "bottlepy/bottle#757; blockchain-certificates/cert-viewer#68 (a server that calls itself)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["fetch_metrics", "http-server"],
    "cause": r"deadlock|itself|single-threaded|same (server|process|thread)",
    "hangs_after": 1,
}

PORT: list[int] = []


def fetch_metrics() -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT[0]}/metrics") as resp:
        return resp.read()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok" if self.path == "/metrics" else fetch_metrics()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)  # one request at a time
    PORT.append(server.server_address[1])
    threading.Thread(target=server.serve_forever, name="http-server", daemon=True).start()
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT[0]}/report") as resp:
        print(resp.read())


if __name__ == "__main__":
    main()
