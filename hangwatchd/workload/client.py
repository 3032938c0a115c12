"""What a workload imports: ``beat()`` in its loop, ``register()`` if nobody launched it.

``beat()`` is one Python call and one write into shared memory: no system
call, no lock, no allocation. In a process nobody launched through
``hangwatchd run`` or registered, it does nothing, almost for free.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..config import client_runtime_dir
from ..host import procfs
from ..model import ProcessId, Registration
from . import beat_segment, exits, introspect, registration_file

BEAT_FILE_ENV = "HANGWATCHD_BEAT_FILE"
# Set by ``hangwatchd run`` for everything below it: a process that inherits them and
# beats, but is not the one the segment was made for (a rank under torchrun, srun,
# mpirun, deepspeed), registers itself as a rank of that job on its first beat.
JOB_ENV = "HANGWATCHD_JOB"
TIMEOUT_ENV = "HANGWATCHD_HEARTBEAT_TIMEOUT"
STACK_TIMEOUT_ENV = "HANGWATCHD_STACK_TIMEOUT"
ON_HANG_ENV = "HANGWATCHD_ON_HANG"  # hangwatchd run --on-hang, carried into the ranks' own registrations


# The segment's mapping: None until the first beat looks for it, False when there is none.
_mm: Any = None  # an mmap once found
_counter: Any = None  # an itertools.count once found
_pack = beat_segment.BEAT.pack_into
_offset = beat_segment.BEAT_OFFSET
_now = time.monotonic_ns


def beat() -> None:
    """Tell the watchdog this process made progress. Call it once per step or request."""
    mm = _mm
    if mm:
        _pack(mm, _offset, next(_counter), _now())
    elif mm is None:
        _find_segment()


def _find_segment() -> None:
    """Find this process's segment once; from then on every beat goes straight to it.

    The pid is checked here, once, not on every beat: a fork resets the mapping
    (``register_at_fork``), so a child comes back here on its first beat.
    """
    global _mm
    _mm = False
    path = os.environ.get(BEAT_FILE_ENV)
    if path:
        introspect.install()  # where hangwatchd run's sitecustomize could not (python -I), or after a fork
        try:
            owner = beat_segment.read(path).pid
        except beat_segment.SegmentError:
            return
        # Only the process the segment was made for may beat into it, not its forks.
        if owner == os.getpid():
            _attach(path)
            beat()
        elif JOB_ENV in os.environ and _register_as_rank(launcher=owner):
            beat()


def _register_as_rank(launcher: int) -> bool:
    """A rank below ``hangwatchd run -- LAUNCHER``: a segment and a registration of its own."""
    env = os.environ
    return register(job=env.get(JOB_ENV) or registration_file.job_of(env) or f"run-{launcher}",
                    heartbeat_timeout=_positive(env.get(TIMEOUT_ENV)), stack_timeout=_positive(env.get(STACK_TIMEOUT_ENV)),
                    launcher=launcher, on_hang=env.get(ON_HANG_ENV) if env.get(ON_HANG_ENV) in ("report", "abort") else None)


def _positive(text: str | None) -> float | None:
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value and value > 0 else None


def _attach(path: str) -> None:
    global _mm, _counter
    _mm, _counter = beat_segment.open_for_writing(path)


def _reset_after_fork() -> None:
    global _mm
    _mm = None


os.register_at_fork(after_in_child=_reset_after_fork)


def register(
    job: str | None = None,
    rank: int | None = None,
    heartbeat_timeout: float | None = None,
    runtime_dir: str | os.PathLike[str] | None = None,
    stack_timeout: float | None = None,
    launcher: int | None = None,
    on_hang: str | None = None,
) -> bool:
    """Register this process with the daemon and start beating into a segment of its own.

    Returns False (after one warning on stderr) when there is no runtime dir to
    register in; the program goes on unwatched. ``launcher``: the pid of the
    launched process this one runs below (set when a rank registers itself).
    """
    base = Path(runtime_dir) if runtime_dir else client_runtime_dir()
    me = procfs.identify(os.getpid())
    if me is None:
        return False
    beats = base / "beats"
    try:
        beat_file = beats / f"{me.pid}-{me.start_time}.beat"
        beat_segment.create(str(beat_file), me.pid)
        env = os.environ
        reg = Registration(
            process=me, uid=os.getuid(), job=job or env.get("TORCHELASTIC_RUN_ID"),
            **registration_file.ranks_from_env(env, rank),
            heartbeat_timeout=heartbeat_timeout, stack_timeout=stack_timeout, beat_file=str(beat_file),
            cmdline=procfs.cmdline(me.pid), source="rank" if launcher else "register", registered_at=time.time(),
            launcher=launcher, on_hang=on_hang,
        )
        path = registration_file.write(base / "registrations", reg)
    except OSError as exc:
        print(f"hangwatchd: cannot register with the daemon in {base} ({exc.strerror}); running unwatched", file=sys.stderr)
        return False
    os.environ[BEAT_FILE_ENV] = str(beat_file)
    _attach(str(beat_file))
    atexit.register(_unregister, path, beat_file, base, me)
    introspect.install(runtime_dir=str(base))
    return True


def _unregister(path: Path, beat_file: Path, base: Path, me: ProcessId) -> None:
    # First say it is exiting and when (its last beat with it): the daemon then keeps it for
    # its job-mates' incidents rather than taking the removed registration for a goodbye.
    exits.write(base, me, None, time.time(), str(beat_file))
    for p in (path, beat_file):
        try:
            p.unlink()
        except OSError:
            pass
