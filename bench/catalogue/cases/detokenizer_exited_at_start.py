"""An SGLang-style detokenizer process exits at start-up and the scheduler waits on it: the
detokenizer (``run_detokenizer``, process DetokenizerManager) fails to load its tokenizer and
exits with status 1. The scheduler created the socket pair before forking and never closed the
detokenizer's end, so its ``recv()`` waits forever instead of seeing the peer close: the
server is half-dead, accepting work and answering none.

Reports: sgl-project/sglang#21471 ("When the DetokenizerManager constructor fails ... leaving
the server in a half-dead state"); sgl-project/sglang#514 ("Crash the server when error or OOM
happens. Otherwise, the requests will hang forever").
"""

import multiprocessing as mp
import socket
import sys

CASE = {
    "title": "detokenizer process exited at start-up; scheduler waits on its socket",
    "source": "sgl-project/sglang#21471; sgl-project/sglang#514 (a dead subprocess, a server that waits)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["DetokenizerManager", "run_detokenizer"],
    "cause": r"exited|died|is gone|status 1",
    "hangs_after": 1,
}


def run_detokenizer(sock: socket.socket) -> None:
    try:
        raise OSError("Unable to load vocabulary from file (429 Too Many Requests)")
    except OSError as exc:
        print(f"DetokenizerManager hit an exception: {exc}", file=sys.stderr)
        sys.exit(1)


def wait_for_detokenized(sock: socket.socket) -> bytes:
    return sock.recv(4096)


def main() -> None:
    scheduler_end, detok_end = socket.socketpair()
    proc = mp.get_context("fork").Process(target=run_detokenizer, args=(detok_end,), name="DetokenizerManager")
    proc.start()
    # detok_end.close() is missing here: the peer's exit closes nothing this process can see
    scheduler_end.sendall(b"tokens 17 42 9")
    wait_for_detokenized(scheduler_end)


if __name__ == "__main__":
    main()
