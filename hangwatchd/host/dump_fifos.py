"""The exception FIFOs: one per watched process, the daemon's own, where the CUDA driver writes a GPU
exception's dump while the process is still alive.

``hangwatchd run`` points ``CUDA_COREDUMP_FILE`` at ``DUMP_DIR/exceptions/UID/core.%p.nvcudmp``.
Before the workload starts, the daemon makes that name a FIFO for the process (``add``): in
directories of root's that no user can list, create, rename or unlink in (``exceptions/`` and
``exceptions/UID/``, 0711), owned by the process's user, mode 0600 (nobody else can open it). It
holds the FIFO's read end open without blocking, and a write end of its own, so the read end never
sees end-of-file or a hang-up, whoever opens and closes it. When the process hits an exception,
the driver opens the FIFO (at once: a reader is there) and writes; the pipe holds ``WAIT_PIPE``
bytes and then the driver's thread blocks in ``write``, so the process stays alive where the error
surfaced until somebody drains it. This thread sees the first bytes (``epoll``), reads the ELF
header (64 bytes: never enough to let a real dump finish) and posts ``ExceptionBegun`` to the
loop; the daemon takes the process's stacks and ``/proc`` facts, then asks (``drain``) for the
dump to be read into the incident, which this thread does as the bytes come, never blocking,
until the size the header gives, the writer's process gone, the cap or the capture's deadline:
then ``ExceptionDrained``.

The same FIFO carries a dump the daemon asks for (``CUDA_COREDUMP_PIPE``): the capture step
``claim``s it first, so those bytes go to the step, not to an exception's incident.

Everything here is bounded and named: a header that is not a CUDA coredump's, a dump that stops
coming, one past the cap, a writer that dies half way, a process that exits; each ends in a value
posted with its one line. One thread, one ``epoll``: no worker is held while a dump only might
come. At stop the FIFOs are removed, so a process that faults while no daemon runs gets the
driver's failure to open (it ends as it would have) rather than a driver waiting for a reader. A
FIFO a killed daemon left, of a process still running, stays and is adopted when the process is
admitted again: a driver that waited there for a reader then writes.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import queue
import select
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from ..model import ProcessId, Registration
from . import procfs

log = structlog.get_logger("hangwatchd.fifos")

DIR_NAME = "exceptions"  # under the dump dir
PATTERN = "core.%p.nvcudmp"  # %p: the pid as the process sees itself (its PID namespace)
DIR_MODE = 0o711  # root's: anyone may pass through to their own FIFO, nobody may list, create or unlink
FIFO_MODE = 0o600  # the process's user's: nobody else may open it
WAIT_PIPE = 4096  # the pipe's size until a drain: the driver blocks after one page
DRAIN_PIPE = 1 << 20  # while draining (the kernel may refuse it: then the default stays)
HEADER = 64  # an ELF64 header: enough to tell a CUDA coredump and its size
READ_CHUNK = 1 << 20
PER_WAKE = 16 << 20  # bytes one drain reads before the others get a turn
COMMAND_WAIT = 5.0  # seconds a claim waits for this thread's answer
MAX_BELOW_PER_UID = 256  # FIFOs one user's programs below its workloads get (registered ones are held to their own limit)
REFUSED_LOG_EVERY = 60.0  # seconds between two lines saying a user's programs below get no FIFO (one a program: a flood)
ELF_CUDA = 190  # EM_CUDA
ET_CORE = 4


def fifo_dir(dump_dir: Path | str) -> Path:
    return Path(dump_dir) / DIR_NAME


def pattern_for(root: Path | str, uid: int | str) -> str:
    """What ``hangwatchd run`` sets CUDA_COREDUMP_FILE to, for a workload of ``uid``."""
    return str(Path(root) / str(uid) / PATTERN)


def name_for(nspid: int) -> str:
    return PATTERN.replace("%p", str(nspid))


def own_pid(pid: int) -> int:
    """The pid a process sees itself as (the last of /proc/PID/status NSpid): what the driver puts for %p."""
    words = procfs.status(pid).get("NSpid", "").split()
    try:
        return int(words[-1]) if words else pid
    except ValueError:
        return pid


def header_facts(head: bytes) -> tuple[bool, int | None, str | None]:
    """(a CUDA coredump's header, the dump's size it gives (its section headers' end), why not)."""
    if len(head) < HEADER:
        return False, None, f"its writer ended after {len(head)} bytes, before a whole ELF header"
    if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return False, None, f"the first bytes ({head[:8].hex()}) are not an ELF file's, so not a CUDA coredump"
    e_type, machine = struct.unpack_from("<HH", head, 16)
    if machine != ELF_CUDA or e_type != ET_CORE:
        return False, None, f"an ELF file of type {e_type}, machine {machine}, not a CUDA coredump (ET_CORE, EM_CUDA)"
    (shoff,) = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    return True, (shoff + shentsize * shnum) or None, None


@dataclass(frozen=True)
class ExceptionBegun:
    """The driver began writing into a process's FIFO (or somebody did): the stacks come first."""

    registration: Registration
    fifo: str  # the FIFO's path, for the incident
    coredump: bool  # the first bytes are a CUDA coredump's header
    expected: int | None  # bytes the header says the dump has
    note: str | None  # why it is not one, or what else was seen (the FIFO's mode changed by its owner)
    since: float  # time.time() of the first bytes


@dataclass(frozen=True)
class ExceptionDrained:
    """A drain is over: the dump (or as much as came) is at ``path``; ``outcome`` says how it ended."""

    registration: Registration
    path: str | None
    size: int
    outcome: str  # whole, short (its writer ended early), cap, deadline, junk (not a coredump), dropped, error
    note: str | None  # one line for the incident, None when whole


@dataclass
class Drain:
    """Bytes read from a FIFO into a file, up to a cap, until the size its header gives (shared by
    this thread's drains and the capture step's blocking read). The daemon holds a write end of
    its FIFOs too, so a reader never sees end-of-file: a dump is whole when its size is reached,
    and cut short when its writer's process has ended and the pipe is empty."""

    out: int  # the file's descriptor (ours)
    cap: int
    expected: int | None = None
    size: int = 0
    ended: str | None = None  # set once over: whole, cap, error (short: see ``writer_gone``)
    error: str = ""

    def write(self, data: bytes) -> None:
        room = self.cap - self.size
        if len(data) >= room:
            data = data[:room]
            self.ended = "cap"
        view = memoryview(data)
        while view:
            n = os.write(self.out, view)
            view = view[n:]
        self.size += len(data)
        if self.ended is None and self.expected is not None and self.size >= self.expected:
            self.ended = "whole"

    def feed(self, fd: int, budget: int = PER_WAKE) -> bool:
        """Read what the FIFO holds now (up to ``budget`` bytes); True once the drain is over."""
        got = 0
        while self.ended is None and got < budget:
            want = READ_CHUNK if self.expected is None else max(1, min(READ_CHUNK, self.expected - self.size))
            try:
                data = os.read(fd, want)
            except BlockingIOError:
                return False
            except OSError as exc:
                self.ended, self.error = "error", exc.strerror or str(exc)
                return True
            if not data:  # only where nobody holds a write end (a claimed copy after release)
                self.ended = "short"
                return True
            try:
                self.write(data)
            except OSError as exc:
                self.ended, self.error = "error", f"writing the dump: {exc.strerror or exc}"
                return True
            got += len(data)
        return self.ended is not None

    def expect(self, head: bytes) -> None:
        """Its size from its header, once read (a dump read whole meanwhile is over)."""
        self.expected = header_facts(head)[1]
        if self.ended is None and self.expected is not None and self.size >= self.expected:
            self.ended = "whole"

    def writer_gone(self, fd: int) -> None:
        """The process that wrote has ended: what the pipe still holds is the rest."""
        if self.ended is None:
            self.feed(fd, budget=1 << 62)
        if self.ended is None:
            self.ended = "short"

    def note(self, fifo: str, cut: str | None = None) -> str | None:
        """The incident's line for how it ended (None: whole); ``cut``: why it was cut, at a deadline."""
        of = f" of the {self.expected} its header gives" if self.expected else ""
        if self.ended == "whole":
            return None
        if self.ended == "short":
            return f"its writer ended after {self.size} bytes{of} into {fifo}: the dump is cut short"
        if self.ended == "cap":
            return (f"the dump passed the cap of {self.cap} bytes (exception_dump_max_bytes): read no further; "
                    "the driver's write then failed")
        if self.ended == "error":
            return f"reading {fifo} failed after {self.size} bytes: {self.error}"
        return f"{cut or 'the dump did not end'}: {self.size} bytes{of} came"


def wait_readable(fd: int, seconds: float) -> bool:
    """Whether ``fd`` has bytes to read within ``seconds``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, seconds) * 1000))


def read_blocking(fd: int, drain: Drain, deadline: float, fifo: str, gone: Callable[[], bool]) -> str | None:
    """Read a claimed FIFO into ``drain`` until the size its header gives, the cap, the writer's
    process gone (``gone()``), or ``deadline`` (monotonic); None when whole, else the incident's
    line. For a capture step's own thread."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while drain.ended is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return drain.note(fifo, f"the driver did not finish writing into {fifo} by the capture's deadline")
        poller.poll(min(left, 0.2) * 1000)
        if not drain.feed(fd) and gone():
            drain.writer_gone(fd)
    return drain.note(fifo)


@dataclass
class _Fifo:
    reg: Registration
    name: str
    uid_fd: int  # the per-user directory (ours)
    fd: int  # the read end
    wfd: int  # our own write end: the read end never sees end-of-file or a hang-up
    ino: tuple[int, int]
    pidfd: int
    state: str = "watch"  # watch, begun, draining, claimed
    head: bytes = b""
    drain: Drain | None = None
    path: str = ""  # the drain's file
    deadline: float = float("inf")
    exited: bool = False
    since: float = 0.0
    polled: bool = False  # its exit is looked for in /proc (its pidfd cannot be polled here)


@dataclass
class _Command:
    kind: str  # add, claim, release, drain
    process: ProcessId
    reg: Registration | None = None
    into: Path | None = None
    deadline: float = 0.0
    why: str | None = None
    answer: list[object] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class ExceptionFifos:
    """The daemon's FIFOs for its processes' exception dumps; one thread, posting to the loop."""

    def __init__(self, dump_dir: Path, post: Callable[[object], None], cap: int) -> None:
        self.root = fifo_dir(dump_dir)
        self.post = post
        self.cap = cap
        self.on = False
        self.off: str | None = None  # why not, in one line
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fifos: dict[ProcessId, _Fifo] = {}
        self._by_fd: dict[int, tuple[str, _Fifo]] = {}
        self._uid_fds: dict[int, int] = {}
        self._refused_said: dict[int, float] = {}  # uid -> when its programs' refusal was last logged
        self._root_fd = -1
        self._stopping = False
        self._next_look = 0.0  # when processes whose pidfds cannot be polled are looked for next
        self._thread: threading.Thread | None = None
        self.epoll = select.epoll()

    # -- start and stop (the loop's thread) ------------------------------------------------

    def start(self) -> bool:
        """Make (or take back) the root directory and start the thread; False, with ``off`` saying
        why, when the directory cannot be ours."""
        try:
            self._root_fd = _own_dir(self.root.parent, self.root.name, DIR_MODE)
        except OSError as exc:
            self.off = f"{self.root}: {exc.strerror or exc}; GPU exception dumps go to files in the dump dir"
            log.error("exception_fifos_off", error=self.off)
            self.epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            return False
        self.on = True
        self.epoll.register(self._wake_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="exception-fifos", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Remove every FIFO (a fault while no daemon runs then fails to open, and the process ends as
        it would have), close everything."""
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for f in list(self._fifos.values()):
            if f.drain is not None:
                os.close(f.drain.out)
            self._close(f)
        for fd in self._uid_fds.values():
            os.close(fd)
        self._uid_fds.clear()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1
        self.epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- what other threads ask ----------------------------------------------------------

    def add(self, reg: Registration) -> None:
        """Make the FIFO of a watched process (the loop, at admission); this thread does it."""
        if self.on:
            self._send(_Command("add", reg.process, reg))

    def drain(self, process: ProcessId, into: Path | None, deadline: float, why: str | None = None) -> None:
        """Read the begun dump into ``into`` (a new file), by ``deadline`` (monotonic); ``into`` None:
        let the FIFO go instead (the driver's write fails), ``why`` saying why. An
        ``ExceptionDrained`` follows, always."""
        self._send(_Command("drain", process, into=into, deadline=deadline, why=why))

    def claim(self, reg: Registration) -> tuple[int, str]:
        """For a dump the daemon asks for: a descriptor of the process's FIFO's read end (the FIFO made
        now where there is none) and its path, no longer watched here until ``release``. Raises
        OSError with the reason when it cannot be had (an exception's dump is being taken)."""
        if not self.on:
            raise OSError(errno.ENOENT, f"no exception FIFOs here ({self.off or 'off'})")
        cmd = _Command("claim", reg.process, reg)
        self._send(cmd)
        if not cmd.done.wait(COMMAND_WAIT):
            raise OSError(errno.ETIMEDOUT, "the exception FIFOs' thread did not answer")
        answer = cmd.answer[0]
        if isinstance(answer, OSError):
            raise answer
        assert isinstance(answer, tuple)
        return int(answer[0]), str(answer[1])

    def release(self, process: ProcessId) -> None:
        """A claim is over: watched again (whatever the claimer left in the pipe is dropped)."""
        self._send(_Command("release", process))

    def _send(self, cmd: _Command) -> None:
        self._commands.put(cmd)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except OSError:
            pass

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        self._remove_leftovers()
        while not self._stopping:
            due = min((f.deadline for f in self._fifos.values() if f.state == "draining"), default=float("inf"))
            try:
                events = self.epoll.poll(max(0.0, min(1.0, due - time.monotonic())))
            except InterruptedError:
                continue
            for fd, _mask in events:
                if fd == self._wake_r:
                    _empty(self._wake_r)
                    continue
                what, f = self._by_fd.get(fd, ("", None))
                if f is None:
                    continue
                try:
                    self._exited(f) if what == "pidfd" else self._readable(f)
                except Exception as exc:  # one process's FIFO gone wrong, never the thread
                    log.exception("exception_fifo_failed", pid=f.reg.process.pid, error=f"{type(exc).__name__}: {exc}")
                    self._fail(f, f"{type(exc).__name__}: {exc}")
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    self._do(cmd)
                except Exception as exc:  # a command's failure is its answer
                    log.exception("exception_fifo_failed", pid=cmd.process.pid, error=f"{type(exc).__name__}: {exc}")
                    cmd.answer.append(OSError(errno.EIO, f"{type(exc).__name__}: {exc}"))
                    cmd.done.set()
            now = time.monotonic()
            for f in list(self._fifos.values()):
                if f.state == "draining" and now >= f.deadline:
                    self._drained(f, "deadline")
                elif f.polled and not f.exited and now >= self._next_look and not procfs.alive(f.reg.process):
                    self._exited(f)
            if now >= self._next_look:
                self._next_look = now + 1.0

    def _do(self, cmd: _Command) -> None:
        f = self._fifos.get(cmd.process)
        if cmd.kind == "add":
            assert cmd.reg is not None
            if f is None:
                self._make(cmd.reg)
            elif cmd.reg.source != "below":
                f.reg = cmd.reg  # a program below a workload that registered itself since: its own registration
        elif cmd.kind == "claim":
            assert cmd.reg is not None
            f = f or self._make(cmd.reg)
            if f is None:
                cmd.answer.append(OSError(errno.ESRCH, f"no exception FIFO could be made for pid {cmd.process.pid}"))
            elif f.state != "watch" or f.head:
                cmd.answer.append(OSError(errno.EBUSY, "its own GPU exception's dump is being taken, into an incident of its own"))
            else:
                self._unwatch(f)
                f.state = "claimed"
                cmd.answer.append((os.dup(f.fd), self._path(f)))
            cmd.done.set()
        elif cmd.kind == "release":
            if f is not None and f.state == "claimed":
                if f.exited:
                    self._close(f)
                else:
                    _empty(f.fd)
                    self._watch(f)
        elif cmd.kind == "drain":
            if f is None or f.state != "begun":
                self.post(ExceptionDrained(f.reg if f else Registration(cmd.process, -1), None, 0, "error",
                                           "no dump had begun in the process's exception FIFO"))
            elif cmd.into is None:
                self._drained(f, "dropped", cmd.why or "the dump was not read")
            else:
                self._start_drain(f, cmd.into, cmd.deadline)

    def path_for(self, reg: Registration) -> Path:
        """Where the FIFO of ``reg``'s process is (or would be)."""
        return self.root / str(reg.uid) / name_for(own_pid(reg.process.pid))

    def _path(self, f: _Fifo) -> str:
        return str(self.root / str(f.reg.uid) / f.name)

    def _make(self, reg: Registration) -> _Fifo | None:
        """The FIFO for ``reg``'s process in its user's directory (an existing one of ours adopted)."""
        proc = reg.process
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:
            return None
        if not procfs.alive(proc):
            os.close(pidfd)
            return None
        name = name_for(own_pid(proc.pid))
        if reg.source == "below" and sum(1 for x in self._fifos.values() if x.reg.uid == reg.uid) >= MAX_BELOW_PER_UID:
            os.close(pidfd)
            now = time.monotonic()
            if now - self._refused_said.get(reg.uid, -REFUSED_LOG_EVERY) >= REFUSED_LOG_EVERY:
                self._refused_said[reg.uid] = now  # one line a minute per user, however many programs they start
                log.warning("exception_fifo_refused", pid=proc.pid, uid=reg.uid,
                            why=f"{MAX_BELOW_PER_UID} FIFOs of this user; their further programs get none "
                                f"(said once in {REFUSED_LOG_EVERY:g} s)")
            return None
        try:
            uid_fd = self._uid_dir(reg.uid)
            taken = next((x for x in self._fifos.values() if x.uid_fd == uid_fd and x.name == name), None)
            if taken is not None:  # two processes, one name (two PID namespaces): the first keeps it
                raise OSError(errno.EEXIST, f"{name} is pid {taken.reg.process.pid}'s already")
            fd, wfd, st = _fifo_in(uid_fd, name, reg.uid)
        except OSError as exc:
            os.close(pidfd)
            log.error("exception_fifo_failed", pid=proc.pid, uid=reg.uid, error=f"{exc.strerror or exc}")
            return None
        f = _Fifo(reg, name, uid_fd, fd, wfd, (st.st_dev, st.st_ino), pidfd)
        self._fifos[proc] = f
        try:
            self.epoll.register(pidfd, select.EPOLLIN)
            self._by_fd[pidfd] = ("pidfd", f)
        except OSError:  # a kernel whose pidfds cannot be polled: its exit is looked for once a second instead
            f.polled = True
        self._watch(f)
        return f

    def _uid_dir(self, uid: int) -> int:
        fd = self._uid_fds.get(uid)
        if fd is None:
            fd = _own_dir_at(self._root_fd, str(uid), DIR_MODE)
            self._uid_fds[uid] = fd
        return fd

    def _remove_leftovers(self) -> None:
        """FIFOs a killed daemon left, of processes that are gone. Those of live processes stay: a
        driver may wait in one for a reader, and their process's registration, admitted again, adopts
        them (``add``)."""
        try:
            uids = os.listdir(self._root_fd)
        except OSError:
            return
        for entry in uids:
            try:
                uid_fd = _own_dir_at(self._root_fd, entry, DIR_MODE)
            except OSError:
                continue
            try:
                for name in os.listdir(uid_fd):
                    pid = name.removeprefix("core.").removesuffix(".nvcudmp")
                    if not pid.isdigit() or not os.path.exists(f"/proc/{pid}"):
                        _unlink_at(uid_fd, name)
            finally:
                os.close(uid_fd)

    def _watch(self, f: _Fifo) -> None:
        f.state = "watch"
        self._by_fd[f.fd] = ("fifo", f)
        self.epoll.register(f.fd, select.EPOLLIN)

    def _unwatch(self, f: _Fifo) -> None:
        if self._by_fd.pop(f.fd, None) is not None:
            try:
                self.epoll.unregister(f.fd)
            except OSError:
                pass

    def _readable(self, f: _Fifo) -> None:
        if f.state == "draining":
            assert f.drain is not None
            if f.drain.feed(f.fd):
                self._drained(f, f.drain.ended or "whole")
            return
        if f.state != "watch":
            return
        try:
            data = os.read(f.fd, HEADER - len(f.head))
        except BlockingIOError:
            return
        if not f.head:
            f.since = time.time()
        f.head += data
        if len(f.head) >= HEADER:
            self._begun(f)

    def _begun(self, f: _Fifo) -> None:
        coredump, expected, why = header_facts(f.head)
        notes = [why] if why else []
        try:
            mode = stat.S_IMODE(os.fstat(f.fd).st_mode)
        except OSError:
            mode = FIFO_MODE
        if mode != FIFO_MODE:
            notes.append(f"its owner changed the FIFO's mode to {mode:o}: other users could write into it")
        self._unwatch(f)
        f.state = "begun"
        self.post(ExceptionBegun(f.reg, self._path(f), coredump, expected, "; ".join(notes) or None, f.since))

    def _start_drain(self, f: _Fifo, into: Path, deadline: float) -> None:
        out = os.open(into, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        coredump, expected, _ = header_facts(f.head)
        f.drain = Drain(out, self.cap, expected)
        f.path, f.deadline, f.state = str(into), deadline, "draining"
        try:
            f.drain.write(f.head)
        except OSError as exc:
            f.drain.ended, f.drain.error = "error", f"writing the dump: {exc.strerror or exc}"
        if not coredump:  # what is there now, kept for the incident; nothing more is waited for
            f.drain.feed(f.fd, budget=HEADER * 1024)
            self._drained(f, "junk", f"{self._path(f)} gave {f.drain.size} bytes that are not a CUDA coredump "
                                     f"({header_facts(f.head)[2]}): not the driver's; the FIFO is let go, so a later "
                                     "exception of the process is not caught alive")
            return
        if f.drain.ended is not None:
            self._drained(f, f.drain.ended)
            return
        try:
            fcntl.fcntl(f.fd, fcntl.F_SETPIPE_SZ, DRAIN_PIPE)
        except OSError:
            pass  # past the node's pipe-max-size: the default is slower, never wrong
        self._watch(f)
        f.state = "draining"
        if f.drain.feed(f.fd):
            self._drained(f, f.drain.ended or "whole")
        elif f.exited:
            f.drain.writer_gone(f.fd)
            self._drained(f, f.drain.ended or "short")

    def _drained(self, f: _Fifo, outcome: str, note: str | None = None) -> None:
        """A drain is over: posted; then the FIFO is watched again (a process that lives on may fault
        again), or let go where the process is gone or the dump was cut (its writer gets EPIPE)."""
        d = f.drain
        if d is not None:
            if outcome not in ("deadline", "junk"):
                outcome = d.ended or outcome
                d.ended = outcome
            os.close(d.out)
            note = note or d.note(self._path(f), "the driver did not finish writing by the capture's deadline")
        self.post(ExceptionDrained(f.reg, f.path or None, d.size if d else 0, outcome, note))
        f.drain, f.path, f.deadline, f.head = None, "", float("inf"), b""
        self._unwatch(f)
        if outcome == "whole" and not f.exited:
            try:
                fcntl.fcntl(f.fd, fcntl.F_SETPIPE_SZ, WAIT_PIPE)
            except OSError:
                pass
            self._watch(f)
        else:
            self._close(f)

    def _fail(self, f: _Fifo, why: str) -> None:
        if f.state in ("begun", "draining"):
            self._drained(f, "error", f"reading the exception FIFO failed: {why}")
        else:
            self._close(f)

    def _exited(self, f: _Fifo) -> None:
        """The process ended: its FIFO goes, unless a dump from it is under way (what the pipe holds
        is its last words, read by the drain)."""
        f.exited = True
        if self._by_fd.pop(f.pidfd, None) is not None:
            self.epoll.unregister(f.pidfd)
        if f.state == "watch":
            if f.head:  # it ended half way through the header: an exception's start all the same
                self._begun(f)
                return
            self._close(f)
        elif f.state == "draining" and f.drain is not None:
            f.drain.writer_gone(f.fd)
            self._drained(f, f.drain.ended or "short")

    def _close(self, f: _Fifo) -> None:
        """Let go of a FIFO: unwatched, closed, removed from the directory."""
        self._unwatch(f)
        if self._by_fd.pop(f.pidfd, None) is not None:
            try:
                self.epoll.unregister(f.pidfd)
            except (OSError, ValueError):
                pass
        for fd in (f.fd, f.wfd, f.pidfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        f.fd = f.wfd = f.pidfd = -1
        _unlink_at(f.uid_fd, f.name, f.ino)
        if self._fifos.get(f.reg.process) is f:
            del self._fifos[f.reg.process]

    def states(self) -> collections.Counter[str]:
        """How many FIFOs are in each state (watch, begun, draining, claimed): for status and tests."""
        return collections.Counter(f.state for f in list(self._fifos.values()))


def _empty(fd: int) -> None:
    try:
        while os.read(fd, 1 << 16):
            pass
    except OSError:
        pass


def _own_dir(parent: Path, name: str, mode: int) -> int:
    """A descriptor of ``parent/name``, a directory of ours (made where missing; whatever a user
    planted under the name is moved aside first, never followed)."""
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _own_dir_at(pfd, name, mode)
    finally:
        os.close(pfd)


def _own_dir_at(pfd: int, name: str, mode: int) -> int:
    me = os.geteuid()
    for _ in range(3):
        try:
            os.mkdir(name, mode, dir_fd=pfd)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            fd = -1
        if fd >= 0:
            st = os.fstat(fd)
            if st.st_uid == me:
                if stat.S_IMODE(st.st_mode) != mode:
                    os.fchmod(fd, mode)
                return fd
            os.close(fd)
        # Not ours (a link, a file, another user's directory): moved aside, under a name that says so.
        aside = f".{name}-planted-{time.time_ns()}"
        os.rename(name, aside, src_dir_fd=pfd, dst_dir_fd=pfd)
        log.warning("exception_fifo_dir_planted", name=name, moved_to=aside)
    raise OSError(errno.EEXIST, f"{name} keeps being replaced")


def _fifo_in(uid_fd: int, name: str, uid: int) -> tuple[int, int, os.stat_result]:
    """The read end and a write end of FIFO ``name`` in our directory ``uid_fd`` (made, or one of
    ours adopted), owned by ``uid``, mode 0600, its pipe one page."""
    for _ in range(2):
        try:
            os.mkfifo(name, FIFO_MODE, dir_fd=uid_fd)
        except FileExistsError:
            pass
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=uid_fd)
        st = os.fstat(fd)
        if stat.S_ISFIFO(st.st_mode) and st.st_nlink == 1 and st.st_uid in (uid, os.geteuid()):
            break
        os.close(fd)
        _unlink_at(uid_fd, name)
    else:
        raise OSError(errno.EEXIST, f"{name} is not a FIFO of ours")
    if os.geteuid() == 0 and st.st_uid != uid:
        os.fchown(fd, uid, -1)
    os.fchmod(fd, FIFO_MODE)
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, WAIT_PIPE)
    except OSError:
        pass
    try:  # a reader is there (ours): never blocks; our own directory, so the name is still ours
        wfd = os.open(name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=uid_fd)
        if (os.fstat(wfd).st_dev, os.fstat(wfd).st_ino) != (st.st_dev, st.st_ino):
            os.close(wfd)
            raise OSError(errno.EEXIST, f"{name} changed under the daemon")
    except OSError:
        os.close(fd)
        raise
    return fd, wfd, os.fstat(fd)


def _unlink_at(dir_fd: int, name: str, ino: tuple[int, int] | None = None) -> None:
    try:
        if ino is not None:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != ino:
                return
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
