"""The loop's one queue: every worker's result, or its error, comes back here as a value.

As py-spy's sampler sends each sample (or its error) over a channel to the one
consumer that owns the state, every worker of the daemon - samplers, captures,
discovery, the fleet's poller, the flight-recorder warm-up, the NVML listener,
the loop's own chores - ends by posting one frozen value here (from a
``finally``, so an exception arrives as a value too) and never touches a
watched process. The loop sleeps in ``select`` on ``fileno()``; a post wakes it.

Bounded: every producer has a bounded number of results out at once (one sample
per watched process, ``CAPTURES_MAX`` captures, one discovery scan, one
request per write to the store), far below ``LIMIT``; a producer that finds
it full waits for the loop rather than drop a result. The loop never posts.
"""

from __future__ import annotations

import queue
import socket

LIMIT = 65_536


class Inbox:
    def __init__(self, limit: int = LIMIT) -> None:
        self._queue: queue.Queue[object] = queue.Queue(limit)
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        return self._r.fileno()

    def post(self, message: object) -> None:
        """From any thread but the loop's: ``message`` for the loop, which is woken."""
        self._queue.put(message)
        self.wake()

    def wake(self) -> None:
        """Wake the loop (from a thread or a signal handler: a full socket is awake enough)."""
        try:
            self._w.send(b"w")
        except OSError:
            pass

    def drain(self) -> list[object]:
        """On the loop: every message posted so far, in order."""
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._r.close()
        self._w.close()
