"""A JSON file of an incident directory, read one way everywhere: capped in size, never raising past the caller.

Every file in an incident came from a capture of someone's process or was put
there by hand: it may be missing, huge, a directory, or not JSON at all. The
analysis says which file could not be read and why (``Unreadable``); the
reports and the fleet only skip it (``read_json_or_none``). ``nofollow`` opens
without following a link or blocking on a FIFO, for files a workload's user
writes directly.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_JSON = 64 << 20  # bytes; a larger file is not read at all


class Unreadable(Exception):
    """Why a file present could not be read as JSON; ``str()`` is the line the analysis shows."""

    def __init__(self, kind: str, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.kind = kind  # "unreadable", "not_a_file", "too_large" or "not_json"
        self.detail = detail


def read_json(path: Path, cap: int = MAX_JSON, nofollow: bool = False) -> Any:
    """The JSON value in ``path``. Raises FileNotFoundError when it is absent, Unreadable otherwise."""
    flags = os.O_RDONLY | (os.O_NOFOLLOW | os.O_NONBLOCK if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unreadable("unreadable", f"cannot be read ({exc.strerror or exc})") from None
    try:
        if nofollow and not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unreadable("not_a_file", "not a regular file")
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise Unreadable("unreadable", f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if size > cap:
        raise Unreadable("too_large", f"larger than {cap >> 20} MB, not read")
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise Unreadable("not_json", f"not JSON ({str(exc)[:120]})", str(exc)[:120]) from None


def read_json_or_none(path: Path, cap: int = MAX_JSON, nofollow: bool = False) -> Any:
    """The JSON value in ``path``, or None when it is absent or cannot be read."""
    try:
        return read_json(path, cap, nofollow)
    except (OSError, Unreadable):
        return None
