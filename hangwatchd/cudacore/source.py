"""Opening a dump file, raw or compressed, as one read-only mapping.

Compressed dumps are streamed into an anonymous temporary file first, so a
120 MB dump is held once (in the page cache), never twice in Python memory.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Callable

import zstandard

from .errors import CoreDumpError

_MAGIC_OPENERS: list[tuple[bytes, Callable[[Path], IO[bytes]]]] = [
    (b"\xfd7zXZ\x00", lambda p: lzma.open(p, "rb")),
    (b"\x1f\x8b", lambda p: gzip.open(p, "rb")),
    (b"\x28\xb5\x2f\xfd", lambda p: zstandard.ZstdDecompressor().stream_reader(open(p, "rb"), closefd=True)),
    (b"BZh", lambda p: bz2.open(p, "rb")),
]

# Never inflate past this: a hostile "dump" must not fill the disk.
MAX_INFLATED = 8 << 30


def _opener(path: Path) -> Callable[[Path], IO[bytes]] | None:
    with open(path, "rb") as f:
        head = f.read(8)
    for magic, opener in _MAGIC_OPENERS:
        if head.startswith(magic):
            return opener
    return None


@contextlib.contextmanager
def mapped(path: str | os.PathLike[str]) -> Iterator[mmap.mmap | bytes]:
    """Yield the dump's bytes (an mmap, or b'' for an empty file)."""
    p = Path(path)
    try:
        opener = _opener(p)
    except IsADirectoryError:
        raise CoreDumpError(f"{p}: is a directory, not a CUDA coredump") from None
    except FileNotFoundError:
        raise CoreDumpError(f"{p}: no such file") from None
    except PermissionError:
        raise CoreDumpError(f"{p}: permission denied; run as a user who can read it") from None
    if opener is None:
        with open(p, "rb") as f:
            yield from _map(f)
        return
    with tempfile.TemporaryFile(prefix="hangwatchd-dump-") as tmp:
        try:
            with opener(p) as src:
                _copy_bounded(src, tmp)
        except (OSError, EOFError, lzma.LZMAError, zstandard.ZstdError) as exc:
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


def _map(f: IO[bytes]) -> Iterator[mmap.mmap | bytes]:
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        yield b""
        return
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield m
    finally:
        m.close()


@contextlib.contextmanager
def raw_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """A path to the dump uncompressed, for tools that need a plain file (cuda-gdb)."""
    p = Path(path)
    opener = _opener(p)
    if opener is None:
        yield str(p)
        return
    with tempfile.NamedTemporaryFile(prefix="hangwatchd-dump-", suffix=".nvcudmp") as tmp:
        with opener(p) as src:
            _copy_bounded(src, tmp)
        tmp.flush()
        yield tmp.name
