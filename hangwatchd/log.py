"""Structured logging, configured in one place: one JSON object a line on stderr.

Wherever an exception is logged (``log.exception``, or ``exc_info=``), its
traceback goes into the line as structured data (structlog's dict
tracebacks: the exception's type, value and frames), never lost as
``"exc_info": true``.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "json", level: str = "info") -> None:
    if fmt == "json":
        tail: list[structlog.typing.Processor] = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        tail = [structlog.dev.ConsoleRenderer(colors=False)]
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
