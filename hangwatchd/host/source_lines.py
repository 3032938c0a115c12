"""The program's own lines of code where a capture names them, read with the process's user's rights.

A stack names a file and a line; the verdict reads better with the line itself
(``print(data[index])``). The file is the user's: it is read by a short-lived
helper that runs as the process's user (its primary group, no others), through
``/proc/PID/root`` (the process's own view of the file system), so root never
reads a file on a user's behalf that the user could not read; one call for
every line wanted, cut at the capture's deadline, each file read at most 4 MiB
and each line kept at most 200 characters.
"""

from __future__ import annotations

import json
import sys

from . import subproc

MAX_LINES = 16  # lines asked for at once
_READER = r"""
import json, os, stat, sys
out = []
for path, shown, line in json.loads(sys.argv[1]):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        continue
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            continue
        data, chunk = b"", b"x"
        while chunk and len(data) < 4 << 20:
            chunk = os.read(fd, 1 << 20)
            data += chunk
    except OSError:
        continue
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    if 0 < line <= len(lines):
        text = lines[line - 1].decode("utf-8", "replace").strip()[:200]
        if text:
            out.append({"file": shown, "line": line, "code": text})
print(json.dumps(out))
"""


def _interpreters() -> list[str]:
    """Pythons to run the reader with: the daemon's own, then the system's (the user may not reach ours)."""
    return list(dict.fromkeys(p for p in (sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3") if p))


def read(pid: int, uid: int, wanted: list[tuple[str, int]], deadline: float) -> list[dict[str, object]]:
    """``{"file", "line", "code"}`` for each (file as the stack names it, line) that could be read as
    ``uid``; what cannot be read is left out. ``deadline``: time.monotonic()."""
    items = []
    for name, line in wanted[:MAX_LINES]:
        if not name or name.startswith("<") or line <= 0:
            continue  # <string>, <frozen ...>: no file
        path = f"/proc/{pid}/root{name}" if name.startswith("/") else f"/proc/{pid}/cwd/{name}"
        items.append((path, name, line))
    if not items:
        return []
    for python in _interpreters():
        try:
            res = subproc.run_by([python, "-I", "-S", "-c", _READER, json.dumps(items)], deadline, user=uid,
                                 max_output=1 << 20)
        except OSError:  # this interpreter is not the user's to run (a daemon's venv under /root): the next
            continue
        if res.returncode in (126, 127):  # the same, said by setpriv, which could not run it as the user
            continue
        break
    else:
        return []
    if not res.ok:
        return []
    try:
        found = json.loads(res.stdout)
    except ValueError:
        return []
    return [x for x in found if isinstance(x, dict)] if isinstance(found, list) else []
