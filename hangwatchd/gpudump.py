"""A CUDA coredump file made into incident artifacts: symbolized.json and the dump compressed.

Used by the capture step (user-triggered dumps of hung processes) and by the
daemon's watch on the dump dir (dumps the driver wrote on an exception).
"""

from __future__ import annotations

import errno
import json
import re
import os
import stat
import socket
from dataclasses import dataclass
from pathlib import Path

import zstandard

from .cudacore.errors import CoreDumpError
from .cudacore import sandbox
from .cudacore.symbolize import Symbolized

# hangwatchd run sets CUDA_COREDUMP_FILE to DUMP_DIR/core_%h.%p.%t.nvcudmp
NAME_PATTERN = "core_%h.%p.%t.nvcudmp"
_NAME = re.compile(r"^core_(?P<host>.+)\.(?P<pid>\d+)\.(?P<time>\d+)\.nvcudmp$")
DRIVER_LOG_SUFFIX = ".driver-log"  # the launcher's record of coredump: lines that came with no dump


def pid_of(name: str) -> int | None:
    """The pid a dump file name carries (our naming, or the driver's default core_T_HOST_PID.nvcudmp)."""
    m = _NAME.match(name)
    if m:
        return int(m.group("pid"))
    m = re.match(r"^core_\d+_.+_(\d+)\.nvcudmp$", name)
    if m:
        return int(m.group(1))
    m = re.match(r"^nodump_.+\.(\d+)\.\d+" + re.escape(DRIVER_LOG_SUFFIX) + "$", name)
    return int(m.group(1)) if m else None


def expand(pattern: str, pid: int) -> str:
    """A CUDA_COREDUMP_FILE pattern as a glob for this pid (%t is only known once written)."""
    return pattern.replace("%h", socket.gethostname()).replace("%p", str(pid)).replace("%t", "*")


@dataclass(frozen=True)
class Stored:
    files: tuple[str, ...]
    symbolized: Symbolized | None
    note: str | None  # what went wrong, if anything, in one line


def store(dump: Path, outdir: Path, remove_source: bool = True, keep_dump: bool = True) -> Stored:
    """Symbolise ``dump`` into outdir/symbolized.json and keep it as outdir/coredump.nvcudmp.zst.

    A full disk drops the compressed dump but keeps the symbolised report, and says so;
    ``keep_dump=False`` (the report goes to the spool: no room) leaves the dump where it is.
    """
    files: list[str] = []
    notes: list[str] = []
    result: Symbolized | None = None
    try:
        result = sandbox.symbolize(dump)  # in a limited child: the dump is untrusted
        (outdir / "symbolized.json").write_text(json.dumps(result.to_dict(), indent=1))
        files.append("symbolized.json")
    except CoreDumpError as exc:
        notes.append(str(exc))
    target = outdir / "coredump.nvcudmp.zst"
    if not keep_dump:
        notes.append(f"the state dir is full: the dump was not copied, it stays as {dump}; the report is kept")
        return Stored(tuple(files), result, "; ".join(notes))
    try:
        with open(dump, "rb") as src, open(target, "wb") as dst:
            zstandard.ZstdCompressor(level=3, threads=-1).copy_stream(src, dst)
        files.append(target.name)
    except OSError as exc:
        target.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            notes.append("the disk is full: the dump was dropped, the symbolised report is kept")
        else:
            notes.append(f"could not keep the dump ({exc.strerror})")
    if remove_source and target.name in files:
        dump.unlink(missing_ok=True)
    return Stored(tuple(files), result, "; ".join(notes) or None)


def copy_text(src: Path, dst: Path, limit: int = 16 << 20) -> bool:
    """Copy a small file a workload wrote (a driver log) into an incident: never through a
    symlink, only a regular file, at most ``limit`` bytes."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        data = os.read(fd, limit)
    except OSError:
        return False
    finally:
        os.close(fd)
    dst.write_bytes(data)
    return True

