"""One piece of the loop's work at a time, contained: its exception is logged and counted, and the loop goes on.

One process's, file's or dump's trouble (a bug included) must never stop the
watching of all the others. Each failure is ``loop_error`` in the log, with
its traceback, and ``hangwatchd_loop_errors_total{where}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from ..metrics import Metrics

log = structlog.get_logger("hangwatchd.daemon")


class Guard:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def __call__(self, where: str, fn: Callable[..., object], *args: Any, pid: int | None = None) -> bool:
        """Run ``fn(*args)``; False (logged and counted) when it raised."""
        try:
            fn(*args)
            return True
        except Exception as exc:  # one process's, file's or dump's trouble never stops the loop
            self.metrics.loop_errors.labels(**self.metrics.labels(where=where)).inc()
            log.exception("loop_error", where=where, pid=pid, error=f"{type(exc).__name__}: {exc}")
            return False
