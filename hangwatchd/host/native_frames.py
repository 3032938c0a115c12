"""Native frames py-spy could not name (``0x4ce7c3 (?)``), named through the process's own root.

py-spy opens each mapped binary by the path /proc/PID/maps gives, in the daemon's mount
namespace; a process in another one (a container's, ``unshare -m``) maps files the daemon does not
see at that path, or sees another file there. The same path under /proc/PID/root is the process's
own file. What opens there is used only if it is the very file mapped (device and inode as
/proc/PID/maps gives them): a link in the user's tree can lead nowhere else. Read through a
read-only mapping with every offset checked (cudacore.elf), within the caller's deadline.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any

from ..cudacore.elf import EHDR, Elf, ElfError
from .procfs import read_capped

_PHDR = struct.Struct("<IIQQQQQQ")
PT_LOAD = 1
STT_FUNC = 2
MAX_BINARY = 2 << 30  # a binary or library larger than this is not read
MAX_PHDRS = 4096
MAX_MAPS = 16 << 20  # bytes of /proc/PID/maps read (65,530 mappings, the kernel's default limit, fit)


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    major: int
    minor: int
    inode: int
    path: str


def mappings(pid: int) -> list[Mapping]:
    """The file-backed mappings of a process, as /proc/PID/maps lists them."""
    out = []
    try:
        lines = read_capped(f"/proc/{pid}/maps", MAX_MAPS).decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[4] == "0":
            continue
        try:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            out.append(Mapping(start, end, int(parts[2], 16), major, minor, int(parts[4]), parts[5]))
        except ValueError:
            continue
    return out


class _Binary:
    """One mapped ELF file: its loadable segments and its function symbols, sorted."""

    def __init__(self, buf: mmap.mmap, deadline: float) -> None:
        elf = Elf(buf)  # type: ignore[arg-type]  # an mmap is a bytes-like buffer, read in place
        header = EHDR.unpack_from(buf, 0)
        phoff, phentsize, phnum = header[5], header[9], header[10]
        if phnum > MAX_PHDRS or phentsize < _PHDR.size or phoff + phnum * phentsize > len(buf):
            raise ElfError("bad program header table")
        self.loads = [(off, vaddr, filesz) for typ, _f, off, vaddr, _p, filesz, _mem, _a in
                      (_PHDR.unpack_from(buf, phoff + i * phentsize) for i in range(phnum)) if typ == PT_LOAD]
        tables = sorted(elf.symbol_tables(), key=lambda s: s.type)  # .symtab (2) before .dynsym (11)
        funcs = [s for s in elf.symbols(tables[0], deadline) if s.type == STT_FUNC and s.size and s.value] if tables else []
        self.funcs = sorted(((s.value, s.size, s.name) for s in funcs), key=lambda f: f[0])

    def symbol(self, file_offset: int) -> str | None:
        for off, vaddr, filesz in self.loads:
            if off <= file_offset < off + filesz:
                at = file_offset - off + vaddr
                break
        else:
            return None
        lo, hi = 0, len(self.funcs)
        while lo < hi:  # the last function starting at or before `at`
            mid = (lo + hi) // 2
            if self.funcs[mid][0] <= at:
                lo = mid + 1
            else:
                hi = mid
        if lo and at < self.funcs[lo - 1][0] + self.funcs[lo - 1][1]:
            return self.funcs[lo - 1][2]
        return None  # between functions, or in one the file does not name (stripped)


def _open(pid: int, m: Mapping, deadline: float) -> _Binary | None:
    try:
        fd = os.open(f"/proc/{pid}/root{m.path}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_ino != m.inode or os.major(st.st_dev) != m.major
                or os.minor(st.st_dev) != m.minor or not 0 < st.st_size <= MAX_BINARY):
            return None  # not the file that is mapped: never read another one in its place
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as buf:
            return _Binary(buf, deadline)
    except (OSError, ValueError, struct.error):  # ElfError is a ValueError: a binary past the deadline too
        return None
    finally:
        os.close(fd)


def name_unknown_frames(pid: int, threads: list[dict[str, Any]], deadline: float) -> int:
    """Name in place each frame py-spy left as ``0x... (?)``: the binary it is in (as the process
    sees its path) and, where that binary's symbols say, the function. Returns how many changed."""
    unknown = [f for t in threads if isinstance(t, dict) for f in t.get("frames") or []
               if isinstance(f, dict) and f.get("filename") == "?" and str(f.get("name", "")).startswith("0x")]
    if not unknown:
        return 0
    maps = mappings(pid)
    binaries: dict[tuple[int, int, int], _Binary | None] = {}
    changed = 0
    for frame in unknown:
        if time.monotonic() > deadline:
            break
        try:
            addr = int(frame["name"], 16)
        except ValueError:
            continue
        m = next((m for m in maps if m.start <= addr < m.end), None)
        if m is None:
            continue
        key = (m.major, m.minor, m.inode)
        if key not in binaries:
            binaries[key] = _open(pid, m, deadline)
        binary = binaries[key]
        name = binary.symbol(addr - m.start + m.offset) if binary else None
        frame.update(filename=m.path, module=m.path, short_filename=os.path.basename(m.path),
                     resolved_by="/proc/PID/root")
        if name:
            frame["name"] = name
        changed += 1
    return changed
