"""The kernel log, read as it is written: ``/dev/kmsg`` (or any path given), on a thread of its own.

NVML tells a listener that GPU N reported XID 31; only the kernel log says
which process: ``NVRM: Xid (PCI:0000:18:00): 31, pid=2149, name=python3, ...``.
This reader follows the log from the moment it opens it (earlier records are
skipped, as NVML's events are), picks out the ``NVRM: Xid`` lines
(``host/xid.py``) and hands each to ``on_xid`` with its time. It never touches
the daemon's loop: ``on_xid`` records the event and posts it to the loop's
queue (``host/gpu_events.py``).

``/dev/kmsg`` gives one record per ``read()``: ``PRIO,SEQ,USEC,FLAGS;MESSAGE``
then ``\\n``, then continuation lines `` KEY=VALUE`` (which are skipped). A
reader that falls behind the ring buffer gets ``EPIPE`` once, and then the
oldest record still there: counted, logged, and read on. Reading it needs
root (``CAP_SYSLOG`` where ``kernel.dmesg_restrict = 1``); the systemd unit and
the DaemonSet allow it. Any other path works the same, line by line: a FIFO
(the tests write kernel log lines into one; a writer that closes is waited
for again) or a plain file of such lines.

Bounded: one read is at most ``READ_SIZE`` bytes, a line longer than
``MAX_LINE`` is dropped whole, and whatever bytes come in (not UTF-8, NULs, no
newline ever), the reader keeps going (``tests/unit/test_kmsg.py`` fuzzes it).
"""

from __future__ import annotations

import errno
import os
import select
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from . import xid as xids

log = structlog.get_logger("hangwatchd.gpu")

READ_SIZE = 16 << 10  # bytes one read() asks for: /dev/kmsg refuses (EINVAL) a buffer smaller than a record
MAX_LINE = 16 << 10  # bytes of one line kept while its newline has not come; a longer one is dropped whole
POLL_MS = 500  # how long one wait lasts before the reader looks at its stop flag
REOPEN_S = 5.0  # after the log cannot be opened (or a FIFO's writer left): wait this long, then try again


@dataclass(frozen=True)
class Record:
    """One kernel log record: its message, and when it was logged (microseconds on the
    kernel's monotonic clock), where the line said (a plain line of text says nothing)."""

    message: str
    usec: int | None = None
    seq: int | None = None


def parse_record(line: bytes) -> Record | None:
    """One line as /dev/kmsg writes a record (``PRIO,SEQ,USEC,FLAGS[,...];MESSAGE``); a line
    without that prefix is a message of its own; a continuation line (`` KEY=VALUE``) is None."""
    if not line or line[:1] == b" ":
        return None
    text = line.decode("utf-8", "replace")
    head, sep, message = text.partition(";")
    if sep:
        fields = head.split(",")
        if len(fields) >= 4 and all(f.isdigit() for f in fields[:3]):
            return Record(message, int(fields[2]), int(fields[1]))
    return Record(text)


class Lines:
    """Bytes in, whole lines out; a line past MAX_LINE (its newline never coming) is dropped whole."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._buf = bytearray()
        self._dropping = False  # inside a line too long to keep: skip to its newline
        self.dropped = 0

    def feed(self, data: bytes) -> Iterator[bytes]:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            if self._dropping:
                self._dropping = False
            else:
                self._buf += data[start:nl]
                if len(self._buf) <= self.max_line:
                    yield bytes(self._buf)
                else:
                    self.dropped += 1
            self._buf.clear()
            start = nl + 1
        if not self._dropping:
            self._buf += data[start:]
            if len(self._buf) > self.max_line:
                self._buf.clear()
                self._dropping = True
                self.dropped += 1

    def flush(self) -> Iterator[bytes]:
        """The last line of a writer that left without its newline."""
        if self._buf and not self._dropping:
            yield bytes(self._buf)
        self._buf.clear()
        self._dropping = False


def wall_time(usec: int | None, now: float | None = None, mono: float | None = None) -> float:
    """A record's time as a Unix time: its kernel timestamp carried over from the monotonic clock
    (the kernel's log clock), never later than now; now for a line that carries none."""
    now = time.time() if now is None else now
    if usec is None:
        return now
    mono = time.monotonic() if mono is None else mono
    return min(now, now - (mono - usec / 1e6))


class KernelLog(threading.Thread):
    """Follows ``path`` and calls ``on_xid(line, wall_time)`` for each NVRM Xid line, on this thread.

    ``unavailable`` says why nothing is read (no such file, no permission), until it can be."""

    def __init__(self, path: str, on_xid: Callable[[xids.XidLine, float], None], poll_ms: int = POLL_MS,
                 reopen_s: float = REOPEN_S, on_state: Callable[[str | None], None] = lambda _why: None) -> None:
        super().__init__(name="kernel-log", daemon=True)
        self.path = path
        self.on_xid = on_xid
        self.on_state = on_state  # told ``unavailable`` each time it changes
        self.poll_ms = poll_ms
        self.reopen_s = reopen_s
        self.stopping = threading.Event()
        self.ready = threading.Event()  # open and following (or given up for now: ``unavailable`` says why)
        self.unavailable: str | None = None
        self.overruns = 0  # times the ring buffer overwrote records before they were read (EPIPE)
        self.lines = 0

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                fd = self._open()
                if fd is None:
                    self.ready.set()
                    self.stopping.wait(self.reopen_s)
                    continue
                try:
                    self._follow(fd)
                finally:
                    os.close(fd)
        except Exception as exc:  # noqa: BLE001 - a surprise ends the reading, never the daemon
            self._state(f"{type(exc).__name__}: {exc}")
            log.error("kernel_log_failed", path=self.path, error=self.unavailable)
        finally:
            self.ready.set()

    def _open(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError as exc:
            why = f"cannot read {self.path}: {exc.strerror}" + (
                " (reading the kernel log needs root, CAP_SYSLOG where kernel.dmesg_restrict = 1; see docs/gpu-evidence.md)"
                if exc.errno in (errno.EACCES, errno.EPERM) else "")
            if why != self.unavailable:
                log.warning("kernel_log_unavailable", path=self.path, why=why,
                            effect="XIDs are still counted from NVML, without the process that caused them")
            self._state(why)
            return None
        mode = os.fstat(fd).st_mode
        if stat.S_ISCHR(mode) or stat.S_ISREG(mode):
            try:
                os.lseek(fd, 0, os.SEEK_END)  # from now on, as NVML's events are
            except OSError:
                pass
        if self.unavailable is not None:
            log.info("kernel_log_following", path=self.path)
        self._state(None)
        return fd

    def _state(self, why: str | None) -> None:
        if why != self.unavailable:
            self.unavailable = why
            self.on_state(why)

    def _follow(self, fd: int) -> None:
        fifo = stat.S_ISFIFO(os.fstat(fd).st_mode)
        lines = Lines()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        self.ready.set()
        while not self.stopping.is_set():
            if not poller.poll(self.poll_ms):
                continue
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten before we read it; the next read goes on from the oldest left
                    self.overruns += 1
                    log.warning("kernel_log_overrun", path=self.path, overruns=self.overruns,
                                effect="kernel log records were lost before they could be read")
                    continue
                if exc.errno == errno.EINVAL:  # a record larger than our buffer: skipped by the kernel
                    continue
                raise
            if not data:
                if not fifo:  # the end of a plain file: what is appended comes later
                    self.stopping.wait(self.poll_ms / 1000)
                    continue
                for line in lines.flush():  # a FIFO's writer left: open it again for the next one
                    self._line(line)
                return
            for line in lines.feed(data):
                self._line(line)

    def _line(self, line: bytes) -> None:
        record = parse_record(line)
        if record is None or "NVRM" not in record.message:
            return
        found = xids.parse_line(record.message)
        if found is None:
            return
        self.lines += 1
        self.on_xid(found, wall_time(record.usec))
