"""Starting a case's processes and ending every one of them.

Each rank runs in a session of its own (its own process group), so that ending it ends
whatever it forked. Every process a case starts inherits a marker in its environment; after
the case, whatever still carries it is a leak: killed, and reported, so that a case that
escapes its group (a double fork, a setsid) shows up instead of piling up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .cases import Case

MARK = "HANGWATCHD_CATALOGUE_MARK"
TERM_GRACE_S = 3.0


@dataclass
class Running:
    """The processes of one case: one a rank, plus what the runner put beside it."""

    case: Case
    procs: list[subprocess.Popen[bytes]]
    beside: list[subprocess.Popen[bytes]]
    mark: str
    started: float  # time.time() just before the first process started

    @property
    def hung_at(self) -> float:
        return self.started + self.case.hangs_after

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def start(case: Case, prefix: list[str], logdir: Path, env: dict[str, str] | None = None) -> Running:
    """Start the case's ranks, each as ``PREFIX... python3 SCRIPT`` in a session of its own.

    ``prefix`` is the ``hangwatchd run ... --`` part (empty in --check mode); a rank's own
    options (``--rank N``) are added before its ``--``.
    """
    mark = uuid.uuid4().hex
    base = dict(os.environ, **(env or {}), **{MARK: mark, "PYTHONUNBUFFERED": "1"})
    base.pop("HANGWATCHD_BEAT_FILE", None)  # never beat into a segment the runner itself was given
    logdir.mkdir(parents=True, exist_ok=True)
    beside = [_start_beside(case.beside, base, logdir)] if case.beside else []
    port = free_port()
    started = time.time()
    procs = []
    for rank in range(case.ranks):
        argv = _with_rank(prefix, rank) if case.ranks > 1 else list(prefix)
        argv += [sys.executable, str(case.path)]
        renv = dict(base, **rank_env(rank, case.ranks, port)) if case.ranks > 1 else base
        with open(logdir / f"{case.name}.{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=renv, start_new_session=True))
    return Running(case, procs, beside, mark, started)


def _with_rank(prefix: list[str], rank: int) -> list[str]:
    if "--" not in prefix:
        return list(prefix)
    i = prefix.index("--")
    return prefix[:i] + ["--rank", str(rank)] + prefix[i:]


def _start_beside(what: str, env: dict[str, str], logdir: Path) -> subprocess.Popen[bytes]:
    if what == "cpu_hog":
        # Another tenant's busy process on the same cores: the case must not be taken for hung
        # only because it gets half the CPU it would alone.
        code = "while True:\n    pass\n"
        with open(logdir / "cpu_hog.log", "wb") as log:
            return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
    raise ValueError(what)


def stop(run: Running) -> list[str]:
    """End every process group of the case (SIGTERM, then SIGKILL), then anything still marked.

    Returns a line for each process that escaped its group and had to be killed by its mark.
    """
    groups = run.procs + run.beside
    for p in groups:
        _signal_group(p.pid, signal.SIGTERM)
    end = time.monotonic() + TERM_GRACE_S
    for p in groups:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in groups:
        _signal_group(p.pid, signal.SIGKILL)  # also whatever the rank forked, still in its group
        p.wait()
    return reap_marked(run.mark)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def marked(mark: str) -> list[int]:
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def reap_marked(mark: str, grace: float = 2.0) -> list[str]:
    end = time.monotonic() + grace
    while (left := marked(mark)) and time.monotonic() < end:
        time.sleep(0.1)
    leaks = []
    for pid in left:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        leaks.append(f"pid {pid}: {cmd[:160]}")
    return leaks
