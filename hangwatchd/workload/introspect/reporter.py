"""The reporter's life in a process: its FIFO, its one thread, forks, and the exit.

``install()`` makes ``introspect-PID.pipe`` in a directory no other user can
write (the one ``hangwatchd run`` names in ``HANGWATCHD_INTROSPECT_DIR``, else one
of its own under the runtime dir's ``pipes/`` or the temp dir), holds it open for
reading (and for writing too, so that a read waits for a byte instead of
returning at once when nobody has it open), and starts one thread that blocks
in ``read()`` on it: no polling, no CPU while nobody asks. For each byte the
daemon writes (through its own checked descriptor of that very FIFO), the thread
builds the report and writes it as ``introspect-PID.json`` beside the FIFO,
through a temporary file renamed into place.

The thread is a bare ``_thread`` thread: ``threading.enumerate()`` and
``active_count()`` do not count it, and interpreter exit never waits for it.
A fork child re-arms in ``after_in_child``: a FIFO for its own pid and a thread
of its own (threads do not survive fork). Everything the report needs is
imported here, at install: a request imports nothing (a hung ``import`` holds
the import lock).
"""

from __future__ import annotations

import _thread
import atexit
import errno
import os
import stat
import time
from typing import Any

from . import graph_replays, report, tasks_ended, threads

ENABLE_ENV = "HANGWATCHD_INTROSPECT"  # "0": no reporter in this process (hangwatchd run --no-introspect)
DIR_ENV = "HANGWATCHD_INTROSPECT_DIR"  # where hangwatchd run wants the FIFOs
RUNTIME_DIR_ENV = "HANGWATCHD_RUNTIME_DIR"  # as config.RUNTIME_DIR_ENV (this package imports nothing of hangwatchd's)
DEFAULT_RUNTIME_DIR = "/run/hangwatchd"
PIPE = "introspect-{pid}.pipe"
REPORT = "introspect-{pid}.json"


class Reporter:
    def __init__(self, directory: str, own_dir: bool) -> None:
        self.pid = os.getpid()
        self.directory = directory
        self.own_dir = own_dir  # made for this process alone: removed at its exit
        self.fifo = os.path.join(directory, PIPE.format(pid=self.pid))
        self.report = os.path.join(directory, REPORT.format(pid=self.pid))
        self.rfd = -1
        self.wfd = -1
        self.inode: tuple[int, int] = (0, 0)
        self.ident: int | None = None
        self.answered = 0

    def arm(self) -> None:
        for stale in (self.fifo, self.report):  # a process that had this pid before us (exec keeps the pid)
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        os.mkfifo(self.fifo, 0o600)
        self.rfd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self.wfd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(self.rfd, True)
        st = os.fstat(self.rfd)
        self.inode = (st.st_dev, st.st_ino)
        # Wait (a moment, at most a second) for the thread to be running Python: one that never got the
        # GIL before the program took it for good (a C call that keeps it) has no Python frame in a
        # stack, and could not be told from the program's own threads.
        running = _thread.allocate_lock()
        running.acquire()
        _thread.start_new_thread(hangwatchd_introspect_reporter, (self, running))
        running.acquire(timeout=1.0)

    def serve(self, running: Any) -> None:
        self.ident = _thread.get_ident()
        running.release()
        while True:
            try:
                # A program that closes every descriptor (daemonising) may reuse our number for a file of
                # its own: read only while the number still is our FIFO, and never steal its bytes.
                st = os.fstat(self.rfd)
                if (st.st_dev, st.st_ino) != self.inode:
                    return
                got = os.read(self.rfd, 64)
            except OSError:
                return  # our descriptor was closed under us: stop
            if not got or os.getpid() != self.pid:
                return
            try:
                self._answer()
            except BaseException:  # noqa: BLE001 - the reporter never raises into the program
                pass

    def _answer(self) -> None:
        data = report.encode(report.build(_forked))
        tmp = os.path.join(self.directory, "." + REPORT.format(pid=self.pid) + ".tmp")
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, self.report)
        self.answered += 1

    def close_fds(self) -> None:
        for fd in (self.rfd, self.wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.rfd = self.wfd = -1

    def remove(self) -> None:
        for path in (self.fifo, self.report):
            try:
                os.unlink(path)
            except OSError:
                pass
        if self.own_dir:
            try:
                os.rmdir(self.directory)
            except OSError:
                pass


def hangwatchd_introspect_reporter(rep: Reporter, running: Any) -> None:
    """The reporter thread's outermost frame, named so that a stack of it reads as hangwatchd's
    machinery (the analyser's helper-thread pattern), never as the program's own waiting thread."""
    rep.serve(running)


def is_reporter_thread(t: dict[str, Any]) -> bool:
    """Whether a thread of a stack dump (py-spy's JSON) is this reporter's: its outermost frame is
    named for it. Asleep until asked and never the program's, it counts in no stack of the program."""
    return any(isinstance(f, dict) and f.get("name") == hangwatchd_introspect_reporter.__name__
               for f in t.get("frames") or [])


_current: Reporter | None = None
_forked: dict[str, Any] | None = None  # in a fork child: the parent's pid and when
_hooks_installed = False
_install_lock = _thread.allocate_lock()  # taken by install() only, never by the reporter's thread


def installed() -> bool:
    """Whether this very process (not only its parent, before a fork) has a reporter."""
    return _current is not None and _current.pid == os.getpid()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip() not in ("0", "no", "false", "off")


def install(directory: str | None = None, runtime_dir: str | None = None) -> bool:
    """Give this process a reporter (once; again after each fork, by itself). ``directory``: where its
    FIFO goes (else HANGWATCHD_INTROSPECT_DIR, else one of its own under ``runtime_dir``'s pipes/ or
    the temp dir). False when switched off (HANGWATCHD_INTROSPECT=0) or when no directory can be
    had; never raises."""
    global _current, _hooks_installed
    if not enabled():
        return False
    with _install_lock:
        if installed():
            return True
        try:
            where, own = _directory(directory, runtime_dir)
            if where is None:
                return False
            rep = Reporter(where, own)
            rep.arm()
        except Exception:  # noqa: BLE001 - a process without a reporter is only less explained
            return False
        _current = rep
        if not _hooks_installed:
            _hooks_installed = True
            threads.install()
            tasks_ended.install()
            graph_replays.install()
            os.register_at_fork(before=threads.before_fork, after_in_parent=threads.after_fork_in_parent,
                                after_in_child=_after_fork_in_child)
            atexit.register(_at_exit)
        return True


def _usable(path: str) -> bool:
    """A directory of ours that no other user can write into (so nobody can plant our report)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _directory(asked: str | None, runtime_dir: str | None) -> tuple[str | None, bool]:
    """(directory, made for this process alone)."""
    for candidate in (asked, os.environ.get(DIR_ENV)):
        if candidate and _usable(candidate):
            return candidate, False
    runtime = runtime_dir or os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR
    for parent in (os.path.join(runtime, "pipes"), os.environ.get("TMPDIR") or "/tmp"):
        for _ in range(8):
            path = os.path.join(parent, f"introspect-{os.getpid()}-{os.urandom(4).hex()}")
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
                    break
                raise
            if _usable(path):
                return path, True
            break
    return None, False


def _after_fork_in_child() -> None:
    """The child of fork(): the parent's reporter thread is not here; arm one for this pid."""
    global _current, _forked, _install_lock
    _install_lock = _thread.allocate_lock()  # another thread may have held it at the fork
    try:
        threads.after_fork_in_child()
        parent = _current
        if parent is None:
            return
        parent.close_fds()
        _forked = {"parent": parent.pid, "time": time.time()}
        _current = None
        if enabled():
            rep = Reporter(parent.directory, own_dir=False)
            rep.arm()
            _current = rep
    except Exception:  # noqa: BLE001 - a fork child without a reporter is only less explained; it must never fail
        pass


def _at_exit() -> None:
    # The names only: the descriptors go with the process, and closing them would wake the
    # thread (EOF) while the interpreter finalizes.
    rep = _current
    if rep is not None and rep.pid == os.getpid():
        rep.remove()
