"""The process's own account of its threads: ask its in-process reporter, keep introspect.json.

From outside, py-spy sees where each thread is, not what it waits for: which
lock (and who holds it), which thread a ``join`` waits for, whether that thread
still exists, what an asyncio task awaits. A process started by ``hangwatchd
run`` (or that called ``register()``) holds a FIFO named ``introspect-PID.pipe``
and a thread blocked reading it (``workload/introspect``). We find that FIFO
among those the process holds open for reading, owned by its uid, write one
byte through our own checked descriptor of it (never reopening a path), and
watch the FIFO's directory for ``introspect-PID.json``: the directory must be
the process's user's, writable by nobody else, and hold that very FIFO; the
report must be a regular file of that user, at most ``MAX_REPORT`` bytes, a
JSON object nested at most ``MAX_DEPTH`` deep. The hung process's children
(``children.json``, written by the children step) are asked too, within the
same deadline, each into its own directory.

A reporter that does not answer in time cannot run Python: some thread holds
the interpreter's lock in C (py-spy's native stacks say which), or the process
is stopped. The step says which, where ``/proc`` shows it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..host import procfs, untrusted
from ..host.deadline import Deadline
from ..model import Registration
from .base import Phase, StepFailed, StepNotApplicable, poke_held_fifo
from .waitfile import Watch

MAX_REPORT = 4 << 20  # bytes; the reporter caps its own at 2 MiB
MAX_DEPTH = 16
MAX_CHILDREN = 16
PIPE = re.compile(r"introspect-([0-9]+)\.pipe")
REPORT = "introspect.json"
CHILDREN_REPORT = "introspect-children.json"


class NoReporter(StepNotApplicable):
    """The process holds no reporter's FIFO: not Python, not started by ``hangwatchd run``, or
    started with ``--no-introspect`` (or ``python -I``, which ignores PYTHONPATH)."""


@dataclass(frozen=True)
class Reporter:
    """A process's reporter as the process holds it: its FIFO, and the name its report will have."""

    pid: int
    fifo: tuple[int, str, os.stat_result]  # (fd in the process, path as the process sees it, stat)
    owner: int  # the process's one uid
    report: str  # introspect-N.json, N the pid as the process itself sees it (its PID namespace)


def own_pids(pid: int) -> set[int]:
    """The pids a process has, from the host's to its innermost PID namespace's (NSpid)."""
    found = {pid}
    for word in procfs.status(pid).get("NSpid", "").split():
        if word.isdigit():
            found.add(int(word))
    return found


def find_reporter(pid: int, uid: int | None = None) -> Reporter:
    """The reporter's FIFO the process holds; NoReporter when it holds none, StepFailed for a
    process with no single uid (or not ``uid``)."""
    if (procfs.state(pid) or "").startswith(("Z", "X")):
        raise NoReporter(f"pid {pid} has exited (its parent has not reaped it): nothing to ask")
    owner = procfs.uid(pid)
    if owner is None or (uid is not None and owner != uid):
        raise StepFailed(f"pid {pid} has no single uid of its own (setuid, or gone): not asked for its user")
    pids = own_pids(pid)
    for fd, path, st in procfs.held_fifos(pid):
        m = PIPE.fullmatch(os.path.basename(path))
        if m and int(m.group(1)) in pids:
            return Reporter(pid, (fd, path, st), owner, f"introspect-{m.group(1)}.json")
    raise NoReporter(f"pid {pid} holds no reporter FIFO introspect-PID.pipe (not Python, not started by "
                     "hangwatchd run or register(), or --no-introspect)")


def _trusted_dir(watch: Watch, reporter: Reporter, shown: str) -> None:
    """Refused unless the watched directory is the process's user's, writable by nobody else, and
    holds the very FIFO the process holds: no one else can plant the report there."""
    st = os.fstat(watch.dir_fd)
    uid = reporter.owner
    if st.st_uid != uid:
        raise untrusted.Refused("wrong_owner", f"{shown} belongs to uid {st.st_uid}, not uid {uid} that the process runs as")
    if st.st_mode & 0o022:
        raise untrusted.Refused("shared_dir", f"{shown} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                                              "anyone could plant the report")
    name = os.path.basename(reporter.fifo[1])
    try:
        here = os.stat(name, dir_fd=watch.dir_fd, follow_symlinks=False)
    except OSError:
        raise untrusted.Refused("swapped", f"{shown} does not hold the FIFO {name} the process holds") from None
    want = reporter.fifo[2]
    if (here.st_dev, here.st_ino) != (want.st_dev, want.st_ino):
        raise untrusted.Refused("swapped", f"{shown}/{name} is not the FIFO the process holds")


def open_watch(reporter: Reporter) -> Watch:
    """A watch over the directory of the FIFO, as the daemon sees it, or through the process's own
    root (/proc/PID/root: another mount namespace); checked by ``_trusted_dir``."""
    directory = os.path.dirname(reporter.fifo[1])
    why = []
    for shown in (directory, f"/proc/{reporter.pid}/root{directory}"):
        try:
            watch = Watch(Path(shown), reporter.report, reporter.owner)
        except OSError as exc:
            why.append(f"{shown}: {exc.strerror}")
            continue
        try:
            _trusted_dir(watch, reporter, shown)
            return watch
        except untrusted.Refused as exc:
            watch.close()
            if exc.reason != "swapped":
                raise StepFailed(f"refusing the reporter's directory: {exc}") from None
            why.append(str(exc))
    raise StepFailed(f"cannot watch the reporter's directory: {'; '.join(why)}")


def reporter_thread(pid: int, fd: int) -> int | None:
    """The thread of ``pid`` blocked reading its descriptor ``fd`` (the reporter, before it is asked)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")[:4096]
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall", "rb") as f:
                words = f.read(256).split()
        except OSError:
            continue
        if len(words) > 1 and words[0] in (b"0", b"63") and words[1].startswith(b"0x") and int(words[1], 16) == fd:
            return int(tid)  # read(2) is 0 on x86-64, 63 on arm64
    return None


def why_silent(pid: int, tid: int | None, timeout: float) -> str:
    """Why a reporter did not answer, as far as /proc can tell."""
    state = procfs.state(pid) or ""
    if state.startswith(("T", "t")):
        return f"pid {pid} is stopped (state {state}): its reporter cannot run"
    if tid is None:
        return f"no report within {timeout:g} s: its reporter thread could not run Python (a thread holds the GIL in C)"
    tstate = "?"
    for _ in range(10):  # a thread waiting for the GIL wakes every switch interval (5 ms) to ask again
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read(4096)
            tstate = raw[raw.rfind(b")") + 2:].split()[0].decode()
            with open(f"/proc/{pid}/task/{tid}/syscall", "rb") as f:
                call = f.read(256).split()[:1]
        except (OSError, IndexError):
            return f"no report within {timeout:g} s, and its reporter thread {tid} is gone"
        if call and call[0] in (b"202", b"98"):  # futex: x86-64, arm64
            return (f"no report within {timeout:g} s: its reporter thread {tid} woke and waits for the GIL, which "
                    "another thread holds without releasing it (a C call; py-spy's native stacks say which)")
        time.sleep(0.01)
    if tstate == "R":
        return f"no report within {timeout:g} s: its reporter thread {tid} was still building it (running)"
    return f"no report within {timeout:g} s: its reporter thread {tid} is in state {tstate}"


@dataclass
class Asked:
    reporter: Reporter
    watch: Watch
    tid: int | None


def ask(reporter: Reporter) -> Asked:
    watch = open_watch(reporter)
    try:
        tid = reporter_thread(reporter.pid, reporter.fifo[0])
        poke_held_fifo(reporter.pid, reporter.fifo, b"1", reporter.owner)
    except BaseException:
        watch.close()
        raise
    return Asked(reporter, watch, tid)


def collect(asked: Asked, alive: Any, end: float, dest: Path) -> None:
    """Wait (until ``end``) for the report, check it and write it to ``dest``; StepFailed otherwise."""
    r = asked.reporter
    try:
        timeout = max(0.0, end - time.monotonic())
        found = asked.watch.wait(timeout, lambda: not alive())
        if found is None:
            if not alive():
                raise StepFailed(f"pid {r.pid} ended before its reporter answered")
            raise StepFailed(why_silent(r.pid, asked.tid, timeout))
        try:
            fd = asked.watch.open(found, r.owner, MAX_REPORT)
            try:
                raw = untrusted.read_fd(fd, found, MAX_REPORT, max(0.5, end - time.monotonic()))
            finally:
                os.close(fd)
            data = untrusted.json_object(raw, MAX_DEPTH)
        except untrusted.Refused as exc:
            raise StepFailed(f"refusing the report: {exc}") from None
        if data.get("version") != 1 or data.get("pid") not in own_pids(r.pid):
            raise StepFailed(f"{found.name} is not a version 1 report of pid {r.pid}")
        dest.write_text(json.dumps(data))
    finally:
        asked.watch.close()


@dataclass
class IntrospectStep:
    name: str = "introspect"
    phase: ClassVar[Phase] = Phase.FIRST  # after the children are known, before anything that may end the process

    def run(self, target: Registration, outdir: Path, deadline: Deadline) -> tuple[str, ...]:
        end = deadline.at
        pid = target.process.pid
        mine: Asked | None = None
        why_not: StepFailed | None = None
        try:
            mine = ask(find_reporter(pid, target.uid))
        except StepFailed as exc:
            why_not = exc
        kids = self._ask_children(target, outdir)
        files: list[str] = []
        try:
            if mine is not None:
                try:
                    collect(mine, lambda: procfs.alive(target.process), end, outdir / REPORT)
                    files.append(REPORT)
                except StepFailed as exc:
                    why_not = exc
        finally:
            outcome = self._collect_children(kids, end, outdir)
        if outcome:
            (outdir / CHILDREN_REPORT).write_text(json.dumps(outcome, indent=1))
            files.append(CHILDREN_REPORT)
        if why_not is not None and not any(v.get("ok") for v in outcome.values()):
            raise why_not
        return tuple(files)

    def _ask_children(self, target: Registration, outdir: Path) -> list[tuple[dict[str, Any], Asked | str]]:
        """The children the children step captured (children.json), each asked, or why not."""
        try:
            rows = json.loads((outdir / "children.json").read_text()).get("children") or []
        except (OSError, ValueError, AttributeError):
            return []
        out: list[tuple[dict[str, Any], Asked | str]] = []
        for row in rows[:MAX_CHILDREN]:
            if not isinstance(row, dict) or not isinstance(row.get("pid"), int) or not str(row.get("dir") or "").isdigit():
                continue
            try:
                out.append((row, ask(find_reporter(row["pid"], target.uid))))
            except StepFailed as exc:
                out.append((row, str(exc)))
        return out

    def _collect_children(self, kids: list[tuple[dict[str, Any], Asked | str]], end: float, outdir: Path) -> dict[str, Any]:
        outcome: dict[str, Any] = {}
        for row, asked in kids:
            pid = row["pid"]
            if isinstance(asked, str):
                outcome[str(pid)] = {"ok": False, "error": asked}
                continue
            me = procfs.identify(pid)
            try:
                collect(asked, lambda me=me: me is not None and procfs.alive(me), end, outdir.parent / str(row["dir"]) / REPORT)
                outcome[str(pid)] = {"ok": True, "file": f"{row['dir']}/{REPORT}"}
            except (StepFailed, OSError) as exc:
                outcome[str(pid)] = {"ok": False, "error": str(exc)}
        return outcome
