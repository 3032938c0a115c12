"""Opening a dump file, raw or compressed, as one read-only mapping.

Compressed dumps are streamed into an anonymous temporary file first, so a
120 MB dump is held once (in the page cache), never twice in Python memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Callable

from .errors import CoreDumpError


# The decompressors are imported only for a compressed dump: a raw one starts faster.
def _xz(f: IO[bytes]) -> IO[bytes]:
    import lzma

    return lzma.open(f, "rb")


def _gzip(f: IO[bytes]) -> IO[bytes]:
    import gzip

    return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]  # a GzipFile is a binary file object


def _zstd(f: IO[bytes]) -> IO[bytes]:
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(f, closefd=False)


def _bz2(f: IO[bytes]) -> IO[bytes]:
    import bz2

    return bz2.open(f, "rb")


_MAGIC_OPENERS: list[tuple[bytes, Callable[[IO[bytes]], IO[bytes]]]] = [
    (b"\xfd7zXZ\x00", _xz),
    (b"\x1f\x8b", _gzip),
    (b"\x28\xb5\x2f\xfd", _zstd),
    (b"BZh", _bz2),
]

# Never inflate past this: a hostile "dump" must not fill the disk.
MAX_INFLATED = 8 << 30


_OWN_FD = re.compile(r"/proc/self/fd/(\d+)")


def _open(p: Path) -> IO[bytes]:
    """The dump, opened once and never blocking: a FIFO named like a dump is refused, not waited on."""
    own = _OWN_FD.fullmatch(str(p))
    try:
        # The sandbox's child opened the dump before it dropped root: it reads that open file,
        # since reopening /proc/self/fd/N would check the file's permissions again.
        fd = os.dup(int(own.group(1))) if own else os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise CoreDumpError(f"{p}: is a directory, not a CUDA coredump") from None
    except FileNotFoundError:
        raise CoreDumpError(f"{p}: no such file") from None
    except PermissionError:
        raise CoreDumpError(f"{p}: permission denied; run as a user who can read it") from None
    except OSError as exc:
        raise CoreDumpError(f"{p}: cannot be opened ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise CoreDumpError(f"{p}: is a directory, not a CUDA coredump")
        raise CoreDumpError(f"{p}: not a regular file (a FIFO, device or socket), so not a CUDA coredump")
    return open(fd, "rb")


def _opener(f: IO[bytes]) -> Callable[[IO[bytes]], IO[bytes]] | None:
    head = f.read(8)
    f.seek(0)
    for magic, opener in _MAGIC_OPENERS:
        if head.startswith(magic):
            return opener
    return None


@contextlib.contextmanager
def mapped(path: str | os.PathLike[str]) -> Iterator[mmap.mmap | bytes]:
    """Yield the dump's bytes (an mmap, or b'' for an empty file)."""
    p = Path(path)
    with _open(p) as f:
        opener = _opener(f)
        if opener is None:
            yield from _map(f)
            return
        with tempfile.TemporaryFile(prefix="hangwatchd-dump-") as tmp:
            try:
                with opener(f) as src:
                    _copy_bounded(src, tmp)
            except Exception as exc:  # each decompressor has its own error types
                if isinstance(exc, (CoreDumpError, MemoryError)):
                    raise
                raise CoreDumpError(f"{p}: the compressed file is damaged or truncated ({exc})") from None
            tmp.flush()
            yield from _map(tmp)


def _copy_bounded(src: IO[bytes], dst: IO[bytes]) -> None:
    total = 0
    while chunk := src.read(1 << 20):
        total += len(chunk)
        if total > MAX_INFLATED:
            raise CoreDumpError(f"inflates past {MAX_INFLATED >> 30} GiB; not a CUDA coredump")
        dst.write(chunk)


class Mapping(mmap.mmap):
    """A dump's read-only mapping, and ``pread`` for the small tables read once: bytes read
    through the file come from the page cache without mapping its pages into the process. A
    CUDA dump spreads its tables among the registers of every lane, and each page touched
    through the mapping maps its neighbours too (the kernel's fault-around): reading the
    tables of a hung NCCL kernel's 400 warps that way made 20 MB of the dump resident."""

    fd: int

    def pread(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset)


def _map(f: IO[bytes]) -> Iterator[mmap.mmap | bytes]:
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        yield b""
        return
    m = Mapping(f.fileno(), 0, access=mmap.ACCESS_READ)
    m.fd = f.fileno()  # open for as long as the mapping is: both end with mapped()
    try:
        yield m
    finally:
        m.close()


@contextlib.contextmanager
def raw_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """A path to the dump uncompressed, for tools that need a plain file (cuda-gdb)."""
    p = Path(path)
    with _open(p) as f:
        opener = _opener(f)
        if opener is None:
            yield str(p)
            return
        with tempfile.NamedTemporaryFile(prefix="hangwatchd-dump-", suffix=".nvcudmp") as tmp:
            with opener(f) as src:
                _copy_bounded(src, tmp)
            tmp.flush()
            yield tmp.name
