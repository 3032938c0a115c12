"""A CUDA coredump file made into incident artifacts: symbolized.json and the dump compressed.

Used by the capture step (user-triggered dumps of hung processes) and by the
daemon's watch on the dump dir (dumps the driver wrote on an exception).

A file is a CUDA coredump only if it starts like one (a 64-bit little-endian ELF
header, machine EM_CUDA, type ET_CORE): anything else is refused before its
contents are symbolised, compressed or kept. Symbolising and compressing both
run in the sandbox's limited child (a deadline, a CPU limit, one thread, not
root): a junk "dump" costs one killed child, never every core for minutes.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..cudacore import sandbox
from ..cudacore.errors import CoreDumpError
from ..cudacore.layout import EM_CUDA, ET_CORE
from ..cudacore.symbolize import Symbolized
from ..host import untrusted


@dataclass(frozen=True)
class Stored:
    files: tuple[str, ...]
    symbolized: Symbolized | None
    note: str | None  # what went wrong, if anything, in one line


MAX_DUMP = 64 << 30  # bytes: far above any real GPU's dump, below a disk-filling stream
MAX_TEXT = 16 << 20  # bytes of a driver log
ELF_HEADER = 20  # bytes that say ELF, 64-bit, little-endian, ET_CORE, EM_CUDA


def open_dump(dump: Path, uid: int | None) -> int:
    """An fd of a dump a workload wrote: a regular file (never a link, never blocking on a FIFO),
    owned by ``uid`` (the process it belongs to) when given, within MAX_DUMP. Raises untrusted.Refused.

    Root's files are accepted only for root's processes: a copy must hold nothing the
    process's user could not read."""
    return untrusted.open_fd(dump, uid, allow_root=uid == 0, max_size=MAX_DUMP)


def store(dump: Path, outdir: Path, uid: int | None, remove_source: bool = True, keep_dump: bool = True,
          on_symbolized: Callable[[], None] | None = None, deadline: float | None = None) -> Stored:
    """Symbolise ``dump`` into outdir/symbolized.json and keep it as outdir/coredump.nvcudmp.zst.

    ``dump`` is opened once through ``untrusted`` (raises untrusted.Refused) and only that
    open file is read. A full disk drops the compressed dump but keeps the symbolised
    report, and says so; ``keep_dump=False`` (the report goes to the spool: no room)
    leaves the dump where it is. ``on_symbolized`` is called once symbolized.json is written,
    before the dump is compressed: the report need not wait for the compression.
    """
    fd = open_dump(dump, uid)
    try:
        return store_fd(fd, dump, outdir, remove_source, keep_dump, on_symbolized, deadline)
    finally:
        os.close(fd)


def check_header(fd: int, dump: Path) -> None:
    """Raise untrusted.Refused("not_coredump") unless the open file starts like a CUDA coredump."""
    head = os.pread(fd, ELF_HEADER, 0)
    if len(head) < ELF_HEADER or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        raise untrusted.Refused("not_coredump", f"{dump}: not an ELF file, so not a CUDA coredump; left as it is")
    e_type, machine = int.from_bytes(head[16:18], "little"), int.from_bytes(head[18:20], "little")
    if machine != EM_CUDA or e_type != ET_CORE:
        raise untrusted.Refused("not_coredump", f"{dump}: an ELF file of type {e_type}, machine {machine}, "
                                                f"not a CUDA coredump (ET_CORE, EM_CUDA); left as it is")


def store_fd(fd: int, dump: Path, outdir: Path, remove_source: bool, keep_dump: bool = True,
             on_symbolized: Callable[[], None] | None = None, deadline: float | None = None) -> Stored:
    """``store`` of an fd ``open_dump`` opened. Raises untrusted.Refused("not_coredump"),
    before anything is done with it, when the file is not a CUDA coredump. ``deadline``
    (monotonic): the capture's, where one runs; symbolising and compressing are cut at it."""
    check_header(fd, dump)
    files: list[str] = []
    notes: list[str] = []
    result: Symbolized | None = None
    opened = untrusted.fd_path(fd)
    try:
        # In a limited child, through the fd we checked: the dump is untrusted.
        result = sandbox.symbolize(opened, _cut_at(deadline))
        data = result.to_dict()
        if data.get("path") == opened:
            data["path"] = str(dump)  # the name it came by, not the fd it was read through
        (outdir / "symbolized.json").write_text(json.dumps(data, indent=1))
        files.append("symbolized.json")
    except CoreDumpError as exc:
        notes.append(str(exc).replace(opened, str(dump)))
    if on_symbolized is not None and files:
        on_symbolized()
    target = outdir / "coredump.nvcudmp.zst"
    if not keep_dump:
        notes.append(f"the disk is full: the dump was not copied (it stays as {dump}); the report is kept")
        return Stored(tuple(files), result, "; ".join(notes))
    try:
        _compress(fd, dump, target, deadline)
        files.append(target.name)
    except CoreDumpError as exc:  # a limit stopped it, or it failed
        target.unlink(missing_ok=True)
        notes.append(f"could not keep the dump ({str(exc).replace(opened, str(dump))})")
    except OSError as exc:
        target.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            notes.append("the disk is full: the dump was dropped, the symbolised report is kept")
        else:
            notes.append(f"could not keep the dump ({exc.strerror})")
    if remove_source and target.name in files:
        unlink_same(dump, os.fstat(fd))
    return Stored(tuple(files), result, "; ".join(notes) or None)


def _compress(fd: int, src: Path, target: Path, deadline: float | None = None) -> None:
    """``fd`` compressed into a new ``target`` (root's, 0600) by the sandbox's limited child, cut at
    ``deadline`` (monotonic) where there is one. Raises CoreDumpError (a limit stopped it) or
    OSError (ENOSPC: the disk is full)."""
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_size > MAX_DUMP:
            raise CoreDumpError(f"{src} grew past {MAX_DUMP >> 30} GiB")
        limits = _cut_at(deadline)
        if limits.wall_seconds <= 0:
            raise CoreDumpError(f"{src}: not compressed, the capture's deadline had passed")
        sandbox.compress(untrusted.fd_path(fd), untrusted.fd_path(out), limits=limits)
    finally:
        os.close(out)


def _cut_at(deadline: float | None) -> sandbox.Limits:
    """The sandbox's limits, its wall time cut at the capture's ``deadline`` (monotonic) where one runs."""
    limits = sandbox.current()
    if deadline is None:
        return limits
    return dataclasses.replace(limits, wall_seconds=max(0.0, min(limits.wall_seconds, deadline - time.monotonic())))


def unlink_same(path: Path, st: os.stat_result) -> None:
    """Remove ``path`` only while it still names the file we read (not one swapped in since)."""
    try:
        now = os.lstat(path)
    except OSError:
        return
    if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
        path.unlink(missing_ok=True)


def copy_text(src: Path, dst: Path, uid: int | None, limit: int = MAX_TEXT) -> bool:
    """Copy a small file a workload wrote (a driver log) into an incident: only a regular file
    of ``uid`` (the process's user: never another user's planted file, never a link), at
    most ``limit`` bytes. False when there is none or it is refused."""
    if uid is None:
        return False
    try:
        fd = untrusted.open_fd(src, uid, allow_root=uid == 0, max_size=limit)
    except untrusted.Refused:
        return False
    try:
        untrusted.copy_fd(fd, src, dst, limit, 10.0)
    except untrusted.Refused:
        return False
    finally:
        os.close(fd)
    return True
