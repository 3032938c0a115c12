"""The capture workers' threads: a fixed number, taking work under way before new work.

Like ``concurrent.futures.ThreadPoolExecutor`` (``submit`` returns a Future), with
two queues: work that continues a capture already under way (``first``: a capture
whose window has passed, to be finished) is taken before new work (a capture to
start, a chore), so a hang's incident is not stored behind every hang that came
after it. Both queues are bounded by what feeds them (``CAPTURES_MAX`` captures).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

Work = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]


class WorkPool:
    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._cond = threading.Condition()
        self._first: collections.deque[Work] = collections.deque()
        self._new: collections.deque[Work] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, first: bool = False) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` on a worker: before any new work when ``first``. RuntimeError once shut down."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the work pool is shut down")
            (self._first if first else self._new).append((future, fn, args))
            if len(self._first) + len(self._new) > self._idle and len(self._threads) < self.size:  # started as needed
                t = threading.Thread(target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify()
        return future

    def shutdown(self, wait: bool = True, cancel_new: bool = True) -> None:
        """No more work taken; new work not started yet is cancelled (``cancel_new``), work under way
        (``first``) still runs. With ``wait``, returns when the workers have ended."""
        with self._cond:
            self._closed = True
            if cancel_new:
                for future, _, _ in self._new:
                    future.cancel()
                self._new.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for t in threads:
                t.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._first and not self._new and not self._closed:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if self._first:
                    future, fn, args = self._first.popleft()
                elif self._new:
                    future, fn, args = self._new.popleft()
                else:
                    return  # shut down, and nothing left
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the Future carries it, as ThreadPoolExecutor's does
                future.set_exception(exc)
            else:
                future.set_result(result)
