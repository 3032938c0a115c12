"""Healthy look-alike: an HTTP server with no requests. The main thread sits in
``serve_forever`` (a ``select`` loop) for as long as nobody calls; its stack never changes,
and it is exactly what a server is meant to do.

Report: viniciuschiele/flask-apscheduler#41 ("flask main thread is hang, not handler
request": the question of whether an idle server is hung).
"""

import http.server

CASE = {
    "title": "idle HTTP server in serve_forever",
    "source": "viniciuschiele/flask-apscheduler#41 (is an idle server hung?)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(204)
        self.end_headers()


if __name__ == "__main__":
    http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler).serve_forever()
