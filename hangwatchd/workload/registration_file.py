"""Registrations: files in RUNTIME_DIR/registrations, one per watched process.

A registration is only a claim. Before the daemon (root, with ptrace) acts on
one, it checks the claim against /proc: the file is a regular file directly in
the directory, the process lives and started when the file says (a reused pid
is another process), it runs as one uid (real, effective, saved and fs uids
equal: never a setuid program), the file belongs to that user, and the beat
and status files are named as RUNTIME_DIR/beats/NAME (that directory's own
path and one plain name: no link, no '..', no directory in between) and
belong to that user too, never to root unless root wrote the registration.
They are resolved once, here, to the beats directory's descriptor and the base
name (``untrusted.UserFile``); the daemon never looks them up by path again.
Every read goes through ``untrusted``.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypedDict

from ..host import procfs, untrusted
from ..host.atomic import write_atomic
from ..model import ProcessId, Registration
from . import runtime_files

MAX_FILE = 64 * 1024
MAX_DEPTH = 8  # a registration is one flat object (cmdline a list in it): deeper is an attack
READ_DEADLINE = 1.0  # seconds: these are small regular files, a read that takes longer is an attack
SUFFIX = ".json"


class BeatsDir:
    """RUNTIME_DIR/beats as the daemon holds it: opened once, when first needed (the daemon makes
    the directory after it starts), and kept open for the daemon's life."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def fd(self) -> int:
        if self._fd is None:
            self._fd = untrusted.open_dir(self.path)
        return self._fd


class RegistrationError(Exception):
    """A registration that is refused; ``reason`` is the metric label, the message the log line."""

    def __init__(self, reason: str, message: str, uid: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.uid = uid  # the file's owner, where it was opened: whose log budget a refusal spends


def file_name(process: ProcessId) -> str:
    return f"{process.pid}-{process.start_time}{SUFFIX}"


def prepare_dirs(runtime_dir: Path) -> None:
    """The shared dirs: world-writable with the sticky bit, like /tmp, so any user's job can register;
    and driver-logs, the daemon's own, where it makes a directory for each user (``user_dir``)."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("registrations", "beats", "pipes", "exits"):
        d = runtime_dir / sub
        d.mkdir(exist_ok=True)
        if os.stat(d).st_uid == os.geteuid():
            os.chmod(d, 0o1777)
    logs = runtime_dir / runtime_files.DRIVER_LOGS
    st = os.lstat(logs) if os.path.lexists(logs) else None
    if st is not None and st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002:
        # Written by an earlier version (world-writable, with any user's names in it): set aside whole.
        os.rename(logs, runtime_dir / f".{runtime_files.DRIVER_LOGS}-shared-{time.time_ns()}")
    logs.mkdir(mode=0o755, exist_ok=True)
    if os.stat(logs).st_uid == os.geteuid():
        os.chmod(logs, 0o755)


def user_dir(logs: Path, uid: int) -> str | None:
    """``logs/UID``, the user's own directory where their launchers keep the driver's lines (made
    here, owned by the user, in the daemon's directory: no other user can take its name, nor a name
    in it). None when it stands, else why it could not be made."""
    path = logs / str(uid)
    try:
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (uid, os.geteuid()):
            return f"{path} is not a directory of uid {uid}'s"
        if st.st_uid != uid:  # made here: the user's from now on
            os.chown(path, uid, -1, follow_symlinks=False)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return None


def write(directory: Path, reg: Registration) -> Path:
    """Write a registration atomically (a reader never sees half a file)."""
    data = asdict(reg)
    data["pid"] = reg.process.pid
    data["start_time"] = reg.process.start_time
    for key in ("process", "beat_at", "status_at"):  # the daemon's own resolution, never written
        del data[key]
    data["version"] = 1
    path = directory / file_name(reg.process)
    write_atomic(path, json.dumps(data).encode())
    return path


def remove(directory: Path, process: ProcessId) -> None:
    try:
        (directory / file_name(process)).unlink()
    except OSError:
        pass  # gone, or swapped for a directory: nothing of ours to remove


def env_int(env: Mapping[str, str], key: str) -> int | None:
    try:
        return int(env[key]) if env.get(key) not in (None, "") else None
    except ValueError:
        return None


class Ranks(TypedDict):
    rank: int | None
    local_rank: int | None
    world_size: int | None


def ranks_from_env(env: Mapping[str, str], rank: int | None = None) -> Ranks:
    """rank (unless given), local_rank and world_size as torchrun and friends set them."""
    return {"rank": rank if rank is not None else env_int(env, "RANK"),
            "local_rank": env_int(env, "LOCAL_RANK"), "world_size": env_int(env, "WORLD_SIZE")}


def job_of(env: Mapping[str, str], explicit: str | None = None) -> str | None:
    """A job's id: given, or torchelastic's run id, or the rendezvous address all its ranks share."""
    if explicit:
        return explicit
    if env.get("TORCHELASTIC_RUN_ID") and env["TORCHELASTIC_RUN_ID"] != "none":
        return env["TORCHELASTIC_RUN_ID"]
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def from_proc(pid: int, source: str = "capture") -> Registration | None:
    """A registration made from /proc alone, for a process nobody registered (discovery, capture by hand)."""
    me = procfs.identify(pid)
    if me is None:
        return None
    env = procfs.environ(pid, frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"}))
    return Registration(
        process=me, uid=procfs.uid(pid) or 0, job=job_of(env), **ranks_from_env(env),
        cmdline=procfs.cmdline(pid), source=source, registered_at=time.time(),
    )


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], required: bool = False) -> Any:
    value = data.get(key)
    if value is None:
        if required:
            raise RegistrationError("bad_field", f"'{key}' is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RegistrationError("bad_field", f"'{key}' = {repr(value)[:100]} has the wrong type")
    return value


def load(path: Path, beats_dir: Path | BeatsDir) -> Registration:
    """Read and check one registration file; raise RegistrationError saying why it is refused."""
    beats = beats_dir if isinstance(beats_dir, BeatsDir) else BeatsDir(beats_dir)
    name = path.name
    if "/" in name or name.startswith(".") or not name.endswith(SUFFIX):
        raise RegistrationError("bad_name", f"{path}: not a registration file name")
    # Owner checked below against the process it names, once that is known.
    try:
        fd = untrusted.open_fd(path, None, max_size=MAX_FILE)
    except untrusted.Refused as exc:
        raise RegistrationError(exc.reason, f"{exc}") from None
    try:
        st = os.fstat(fd)
        raw = untrusted.read_fd(fd, path, MAX_FILE, READ_DEADLINE)
    except untrusted.Refused as exc:
        raise RegistrationError(exc.reason, f"{exc}") from None
    finally:
        os.close(fd)
    try:
        return _checked(path, st, raw, beats)
    except RegistrationError as exc:
        exc.uid = st.st_uid  # every refusal of an opened file names its owner: its log budget
        raise


def _checked(path: Path, st: os.stat_result, raw: bytes, beats: BeatsDir) -> Registration:
    name = path.name
    try:
        data = untrusted.json_object(raw, MAX_DEPTH)
    except untrusted.Refused as exc:
        raise RegistrationError("bad_json", f"{path}: {exc}") from None
    try:
        pid = _field(data, "pid", int, required=True)
        start = _field(data, "start_time", int, required=True)
        timeout = _field(data, "heartbeat_timeout", (int, float))
        stack_timeout = _field(data, "stack_timeout", (int, float))
        status_file = _field(data, "status_file", str)
        rank = _field(data, "rank", int)
        local_rank = _field(data, "local_rank", int)
        world = _field(data, "world_size", int)
        job = _field(data, "job", str)
        beat_file = _field(data, "beat_file", str)
        cmd = _field(data, "cmdline", list) or []
        source = _field(data, "source", str) or "run"
        registered_at = _field(data, "registered_at", (int, float)) or st.st_mtime
        role = _field(data, "role", str) or "workload"
        launcher = _field(data, "launcher", int)
        on_hang = _field(data, "on_hang", str)
    except RegistrationError as exc:
        raise RegistrationError(exc.reason, f"{path}: {exc}") from None
    if role not in ("workload", "launcher"):
        raise RegistrationError("bad_field", f"{path}: role {role[:50]!r} is neither 'workload' nor 'launcher'")
    if on_hang not in (None, "report", "abort"):
        raise RegistrationError("bad_field", f"{path}: on_hang {on_hang[:50]!r} is neither 'report' nor 'abort'")
    if pid <= 0 or any(t is not None and t <= 0 for t in (timeout, stack_timeout)):
        raise RegistrationError("bad_field", f"{path}: pid, heartbeat_timeout and stack_timeout must be positive")
    process = ProcessId(pid, start)
    if name != file_name(process):
        raise RegistrationError("bad_name", f"{path}: names another process than pid {pid} started at {start}")
    actual_start = procfs.start_time(pid)
    if actual_start is None:
        raise RegistrationError("no_process", f"{path}: pid {pid} is not running")
    if actual_start != start:
        raise RegistrationError("pid_reused", f"{path}: pid {pid} now belongs to a process started at {actual_start}, not {start}")
    try:
        owner = untrusted.process_uid(pid)
    except untrusted.Refused as exc:
        raise RegistrationError(exc.reason, f"{path}: {exc}") from None
    if st.st_uid not in (0, owner):
        raise RegistrationError("wrong_owner", f"{path}: file of uid {st.st_uid} registers pid {pid}, which runs as uid {owner}")
    # Root's own files count only where root wrote the registration: a user never gets
    # the daemon to read, or later delete, a file of root's by naming it.
    by_root = st.st_uid == 0
    beat_at = _resolve(path, "beat file", beat_file, beats, owner, by_root) if beat_file is not None else None
    # The status file is written only once the workload sends STATUS=: it may not exist yet.
    status_at = (_resolve(path, "status file", status_file, beats, owner, by_root, must_exist=False)
                 if status_file is not None else None)
    return Registration(
        process=process, uid=owner, job=job, rank=rank,
        local_rank=local_rank, world_size=world, heartbeat_timeout=float(timeout) if timeout else None,
        stack_timeout=float(stack_timeout) if stack_timeout else None, beat_file=beat_file, status_file=status_file,
        cmdline=tuple(str(c)[:4096] for c in cmd[:64]), source=source,
        registered_at=float(registered_at), ras_addr=_ras_addr(data), role=role, launcher=launcher, on_hang=on_hang,
        beat_at=beat_at, status_at=status_at,
    )


def _ras_addr(data: dict[str, Any]) -> str | None:
    """The job's NCCL RAS address as registered; a malformed one is dropped (the environment still says)."""
    value = data.get("ras_addr")
    return value if isinstance(value, str) and 0 < len(value) <= 300 and ":" in value else None


def _resolve(path: Path, what: str, named: str, beats: BeatsDir, owner: int, by_root: bool,
             must_exist: bool = True) -> untrusted.UserFile:
    try:
        beats_fd = beats.fd()
    except OSError as exc:
        raise RegistrationError("bad_beat_file", f"{path}: {beats.path} is not the daemon's beats directory "
                                                 f"({exc.strerror or exc})") from None
    try:
        return untrusted.resolve_in(beats_fd, beats.path, named, owner, allow_root=by_root, must_exist=must_exist,
                                    max_size=MAX_FILE)
    except untrusted.Refused as exc:
        raise RegistrationError("bad_beat_file", f"{path}: {what} {exc}") from None
