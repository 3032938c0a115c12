"""The one way a file is written whole: a reader sees the old file or the new one, never half of one.

Every writer of the daemon and of the job side comes here (registrations, beat
segments, exit and ended records, status.json and health.json, incident.json,
pages, the store's outbox, an incident's proc.json stamped with its node):
one set of guarantees, the strongest any of them needed.

- The temporary file is fresh and ours: a new name in the same directory
  (pid and random), created with ``O_EXCL | O_NOFOLLOW``, so a name someone
  planted in a directory anyone may write (the runtime dir, the dump dir) is
  never followed or reused.
- It is renamed over the target (``os.replace``): atomic on one file system.
- ``fsync``: the data, then the directory entry, are on disk before it
  returns (what must survive a crash: an incident's record).
- On any failure the temporary file is removed: a full disk gets its space
  back, and no stray is left to be mistaken for data.

Standard library only, Python 3.9: the job side (``hangwatchd run``) writes through it too.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


def write_atomic(path: PathLike, data: bytes, mode: int = 0o644, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` whole (see the module's promises). Raises OSError."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
