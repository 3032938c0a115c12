"""Main puts uploads on a queue and joins it. The uploader took one and is stuck sending it (a
socket whose peer never answers); the other worker waits in ``get`` for more, as workers do.
``Queue.join`` waits for the item the stuck uploader holds: the verdict must follow the chain to
its read, never blame the idle worker for a ``task_done`` it did not skip."""

import queue
import socket
import threading

work: "queue.Queue[str]" = queue.Queue()
silent, _peer = socket.socketpair()  # the peer is held and never sends


def upload(key: str) -> None:
    silent.sendall(key.encode())
    silent.recv(1)  # the acknowledgement that never comes


def uploader() -> None:
    while True:
        key = work.get()
        upload(key)
        work.task_done()


if __name__ == "__main__":
    for name in ("uploader-1", "uploader-2"):
        threading.Thread(target=uploader, name=name, daemon=True).start()
    work.put("a")
    print("READY", flush=True)
    work.join()
