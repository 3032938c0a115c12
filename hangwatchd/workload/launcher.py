"""``hangwatchd run -- CMD``: start a workload ready to be watched and debugged.

The CUDA coredump and flight-recorder variables only work if set before CUDA
starts, so the launcher sets them (never overriding the user's), gives the
workload a beat segment, registers it, forwards signals and exits with its
status. Without a daemon the workload still runs, after one warning.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..config import RUNTIME_DIR_ENV, Config
from ..cudacore import driverlog
from ..host import pdeathsig, procfs
from ..host.atomic import write_atomic
from ..model import ProcessId, Registration
from . import beat_segment, dump_names, ended, exits, registration_file, runtime_files
from .client import BEAT_FILE_ENV, JOB_ENV, ON_HANG_ENV, STACK_TIMEOUT_ENV, TIMEOUT_ENV
from .introspect import DIR_ENV as INTROSPECT_DIR_ENV
from .introspect import ENABLE_ENV as INTROSPECT_ENV

COREDUMP_FLAGS = ("skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,"
                  "skip_local_memory,skip_constbank_memory")
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Commands that start the ranks rather than being one: watched for their exit, never for beats.
LAUNCHERS = frozenset({"torchrun", "srun", "mpirun", "mpiexec", "deepspeed", "accelerate", "horovodrun", "jsrun", "aprun"})
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher.runner"})
FIFO_WAIT = 2.0  # seconds the workload waits, before it starts, for the daemon's exception FIFO


@dataclass(frozen=True)
class Launch:
    command: tuple[str, ...]
    runtime_dir: Path
    job: str | None = None
    rank: int | None = None
    heartbeat_timeout: float | None = None
    stack_timeout: float | None = None
    on_hang: str | None = None  # "abort": the daemon ends the job's ranks once the hang's incident is stored
    introspect: bool = True  # the in-process reporter in every Python process of the job (--no-introspect: none)


def workload_env(base: Mapping[str, str], runtime_dir: Path, dump_dir: Path, tag: str) -> dict[str, str]:
    """The workload's environment: ours added only where the user set nothing."""
    ours = {
        "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1",
        "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
        "CUDA_COREDUMP_SHOW_PROGRESS": "1",
        "CUDA_COREDUMP_GENERATION_FLAGS": COREDUMP_FLAGS,
        "CUDA_COREDUMP_PIPE": str(runtime_dir / "pipes" / "cuda_pipe.%p"),
        # %h now, as this workload's host name: a daemon in another UTS namespace (a sidecar
        # container beside a job on the node) would expand it to its own and never see the dump.
        "CUDA_COREDUMP_FILE": str(dump_dir / dump_names.NAME_PATTERN.replace("%h", socket.gethostname())),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # PyTorch appends the rank (and ".pipe" to the pipe) to these prefixes.
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(runtime_dir / "pipes" / f"nccl_trace_{tag}_"),
        RUNTIME_DIR_ENV: str(runtime_dir),
    }
    env = dict(base)
    for key, value in ours.items():
        env.setdefault(key, value)
    # PyTorch 2.11 reads TORCH_FR_* and warns on the old names, older ones read only the old
    # names: set both, and where the user set one of a pair, the other follows the user's.
    for old, new, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "2000"),
                            ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", str(dump_dir / f"nccl_trace_{tag}_"))):
        chosen = base.get(new) or base.get(old) or value
        env.setdefault(old, chosen)
        env.setdefault(new, chosen)
    archive = archive_of(__file__)
    if archive and archive not in env.get("PYTHONPATH", "").split(os.pathsep):
        # Started from hangwatchd-job.pyz (workload/bundle.py): the job imports hangwatchd from it too,
        # with nothing installed. Last on the path: anything the user put there comes first.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), archive) if p)
    if not env.get("NCCL_RAS_ADDR"):
        # Every NCCL process serves RAS on one port, by default 28028; only one job on a node
        # can hold it, so each launched workload gets a free port of its own.
        port = free_local_port()
        if port:
            env["NCCL_RAS_ADDR"] = f"127.0.0.1:{port}"
    return env


def bootstrap_dir() -> str:
    """The directory whose sitecustomize installs the in-process reporter (inside hangwatchd-job.pyz
    too: zipimport reads a path within an archive)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "introspect", "bootstrap")


def introspect_dir(runtime_dir: Path, tag: str) -> Path | None:
    """A directory for the job's reporters' FIFOs and reports: the job's own (0700, so nobody else can
    plant a report in it), in the runtime dir's pipes/ where the daemon can reach it from another
    container, else in the job's temp dir (the daemon reaches it through /proc/PID/root)."""
    for parent in (runtime_dir / "pipes", None):
        try:
            return Path(tempfile.mkdtemp(prefix=f"introspect-{tag}-", dir=parent))
        except OSError:
            continue
    return None


def introspect_env(env: dict[str, str], directory: Path | None) -> None:
    """The reporter in every Python process of the workload: our sitecustomize first on PYTHONPATH
    (it hands on to the one that would have run), and where to put the FIFOs. Off where the user
    switched it off (HANGWATCHD_INTROSPECT=0) or we could make no directory."""
    if directory is None or env.get(INTROSPECT_ENV, "1").strip() in ("0", "no", "false", "off"):
        env[INTROSPECT_ENV] = "0"
        return
    env[INTROSPECT_DIR_ENV] = str(directory)
    site = bootstrap_dir()
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    env["PYTHONPATH"] = os.pathsep.join([site, *rest])


def archive_of(module_file: str) -> str | None:
    """The zip archive (the job-side bundle, a wheel on PYTHONPATH) a module was imported from, or None."""
    for parent in Path(module_file).parents:
        if parent.is_file():
            return str(parent)
    return None


def free_local_port() -> int | None:
    """A TCP port on localhost nobody holds now (NCCL binds it moments later), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    except OSError:
        return None
def role_of(command: tuple[str, ...]) -> str:
    """'launcher' for torchrun, srun, mpirun, deepspeed (and python -m torch.distributed.run), else 'workload'."""
    if not command:
        return "workload"
    if os.path.basename(command[0]) in LAUNCHERS:
        return "launcher"
    for i, arg in enumerate(command[1:-1], 1):
        if arg == "-m" and command[i + 1] in LAUNCHER_MODULES:
            return "launcher"
    return "workload"


def ranks_env(env: dict[str, str], job: str | None, launch: Launch) -> None:
    """What a rank below this workload needs to register itself on its first beat (see client.py)."""
    env[JOB_ENV] = job or ""
    for key, value in ((TIMEOUT_ENV, launch.heartbeat_timeout), (STACK_TIMEOUT_ENV, launch.stack_timeout)):
        if value:
            env[key] = f"{value:g}"
    if launch.on_hang:
        env[ON_HANG_ENV] = launch.on_hang


def run(launch: Launch) -> int:
    """Start the workload, watch over its registration, return its exit status."""
    info = runtime_files.daemon_info(launch.runtime_dir)
    dump_dir = Path(info["dump_dir"]) if info and info.get("dump_dir") else Config().dumps
    if info is None:
        print(f"hangwatchd: no daemon is running (runtime dir {launch.runtime_dir}); "
              "the workload runs, and is watched once a daemon starts", file=sys.stderr)
    tag = f"{os.getpid()}-{secrets.token_hex(2)}"
    env = workload_env(os.environ, launch.runtime_dir, dump_dir, tag)
    # An outer hangwatchd run (hangwatchd run -- torchrun --no-python hangwatchd run -- ...) names the job.
    job = registration_file.job_of(env, launch.job or os.environ.get(JOB_ENV))
    ranks_env(env, job, launch)
    reports = introspect_dir(launch.runtime_dir, tag) if launch.introspect and env.get(INTROSPECT_ENV, "1") != "0" else None
    introspect_env(env, reports)
    segment = launch.runtime_dir / "beats" / f"run-{tag}.beat"
    beat_file: Path | None = segment
    notify: NotifyProxy | None = None
    try:
        beat_segment.create(str(segment), 0)
        env[BEAT_FILE_ENV] = str(segment)
        notify = NotifyProxy(launch.runtime_dir / "beats" / f"run-{tag}", segment, env.get("NOTIFY_SOCKET"))
        env["NOTIFY_SOCKET"] = str(notify.address)
        if launch.heartbeat_timeout and "WATCHDOG_USEC" not in env:
            env["WATCHDOG_USEC"] = str(int(launch.heartbeat_timeout * 1e6))
    except OSError as exc:
        if info is not None:  # with no daemon, the line above said it already
            print(f"hangwatchd: cannot prepare the beat segment or notify socket under {launch.runtime_dir} "
                  f"({exc.strerror or exc}); the workload runs unwatched", file=sys.stderr)
        beat_file = None  # no runtime dir we can write: run unwatched

    launcher_pid = os.getpid()
    fifo = exception_fifo(info, os.environ, env) if beat_file is not None else None
    if fifo:
        env["CUDA_COREDUMP_FILE"] = fifo
    # The child registers itself before exec and says so here: a failed exec leaves nothing behind.
    said_r, said_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def registration(pid: int) -> Registration | None:
        process = procfs.identify(pid)
        if process is None:
            return None
        return Registration(
            process=process, uid=os.getuid(), job=job,
            **registration_file.ranks_from_env(env, launch.rank), role=role_of(launch.command),
            heartbeat_timeout=launch.heartbeat_timeout, stack_timeout=launch.stack_timeout,
            beat_file=str(beat_file), status_file=str(notify.status_file) if notify else None,
            cmdline=tuple(launch.command), source="run", registered_at=time.time(), ras_addr=env.get("NCCL_RAS_ADDR"),
            on_hang=launch.on_hang,
        )

    def prepare_child() -> None:  # in the child, before exec
        # The workload dies with us, even when we are SIGKILLed: nobody would watch it otherwise.
        pdeathsig.die_with_parent(launcher_pid)
        if beat_file is None:
            return
        beat_segment.set_owner(str(beat_file), os.getpid())  # the segment is the child's own
        # Registered before it runs, so the daemon makes its exception FIFO before CUDA can fault.
        reg = registration(os.getpid())
        try:
            if reg is not None:
                registration_file.write(launch.runtime_dir / "registrations", reg)
                os.write(said_w, f"{reg.process.pid} {reg.process.start_time}\n".encode())
        except OSError as exc:
            os.write(2, f"hangwatchd: cannot register the workload ({exc.strerror}); it runs unwatched\n".encode())
            return
        if fifo and not await_fifo(fifo.replace("%p", str(os.getpid())), FIFO_WAIT):
            os.write(2, f"hangwatchd: the daemon made no GPU exception FIFO for pid {os.getpid()} within {FIFO_WAIT:g} s; "
                        "the dump of an exception before it does is lost\n".encode())

    try:
        child = subprocess.Popen(list(launch.command), env=env, preexec_fn=prepare_child, stderr=subprocess.PIPE)
    except FileNotFoundError:
        _cleanup(beat_file, _registered(said_r, said_w), launch.runtime_dir, reports)
        raise LaunchError(f"{launch.command[0]}: command not found") from None
    except PermissionError:
        _cleanup(beat_file, _registered(said_r, said_w), launch.runtime_dir, reports)
        # execvp reports EACCES when some PATH entry is unreadable, even if the command is nowhere.
        if "/" not in launch.command[0] and shutil.which(launch.command[0], mode=os.F_OK, path=env.get("PATH")) is None:
            raise LaunchError(f"{launch.command[0]}: command not found") from None
        raise LaunchError(f"{launch.command[0]}: permission denied") from None
    tee = StderrTee(child, runtime_files.driver_log(launch.runtime_dir / runtime_files.DRIVER_LOGS, os.getuid(), child.pid))
    tee.start()
    if notify is not None:
        notify.workload, notify.workload_uid = procfs.identify(child.pid), procfs.uid(child.pid)
        notify.start()
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: _forward(child, s))
    # The terminal delivers Ctrl-C to the whole foreground group, the child included.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reg_written = _registered(said_r, said_w)
    try:
        code = child.wait()
        ended_at = time.time()
        by = ended.read(launch.runtime_dir, reg_written) if reg_written is not None else None
        if by is not None:  # the daemon ended it (on_hang = abort): say so, and never exit 0
            print(f"hangwatchd: the job was ended by the daemon after incident {by.incident} (on_hang = abort); "
                  f"see `hangwatchd show {by.incident}`", file=sys.stderr)
            code = code if code != 0 else 1
        if reg_written is not None:  # how it ended, for the daemon to tell its job-mates' incidents
            exits.write(launch.runtime_dir, reg_written, code, ended_at, str(beat_file) if beat_file else None,
                        by.incident if by else None)
        tee.join(timeout=5)
        _report_lost_dump(tee.driver_lines, dump_dir, child.pid)
    finally:
        if notify is not None:
            notify.close()
        _cleanup(beat_file, reg_written, launch.runtime_dir, reports)
    return code if code >= 0 else 128 - code


class NotifyProxy(threading.Thread):
    """A NOTIFY_SOCKET for the workload: systemd's protocol, understood as heartbeats.

    WATCHDOG=1 (and READY=1) count as a beat; STATUS= is kept for the status and
    the incident. Every datagram is passed on to the launcher's own NOTIFY_SOCKET,
    if it has one (hangwatchd run under systemd). Anything else is ignored.

    The socket lies in the shared beats dir and may be reached by anyone (the
    workload may run as another user than the launcher), so, like systemd's own
    NotifyAccess=all, only datagrams that the kernel says (SCM_CREDENTIALS) come
    from the workload or a process below it count: anyone else's WATCHDOG=1 would
    keep a hung job "alive", their STATUS= would land in its incident, and their
    WATCHDOG=trigger would reach the unit around ``hangwatchd run``. Those are dropped,
    never forwarded.
    """

    def __init__(self, base: Path, beat_file: Path, upstream: str | None) -> None:
        super().__init__(name="notify", daemon=True)
        self.address = base.with_suffix(".notify")
        self.status_file = base.with_suffix(".status")
        self.upstream = upstream
        self.workload: ProcessId | None = None  # set once it is started; nothing counts before
        self.workload_uid: int | None = None
        self.dropped = 0
        self.address.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # The kernel attaches each sender's real pid, uid and gid to what it sends.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(self.address))
        # Sending needs write permission on the socket. An ordinary user's workload runs as that
        # user: nobody else may send at all (no flood can fill the queue the workload writes to).
        # Root's launcher may start a workload that runs as another user: anyone may send, and
        # the credentials decide.
        os.chmod(self.address, 0o666 if os.geteuid() == 0 else 0o600)
        self.mm, self.counter = beat_segment.open_for_writing(str(beat_file))
        self.closed = False

    def run(self) -> None:
        while not self.closed:
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(UCRED.size))
            except OSError:
                return
            if self.from_workload(sender(ancdata)):
                self._handle(data)
            else:
                self.dropped += 1

    def from_workload(self, cred: tuple[int, int] | None) -> bool:
        """Did the workload (or a process below it) send this? Only then does it count.

        A sender that has exited already (``systemd-notify`` from a shell script) can no
        longer be placed in the tree: it counts when it ran as the workload's own user."""
        if cred is None or self.workload is None:
            return False
        pid, uid = cred
        if procfs.descends_from(pid, self.workload):
            return True
        return procfs.start_time(pid) is None and uid == self.workload_uid

    def _handle(self, data: bytes) -> None:
        for line in data.decode("utf-8", "replace").splitlines():
            if line in ("WATCHDOG=1", "READY=1"):
                beat_segment.BEAT.pack_into(self.mm, beat_segment.BEAT_OFFSET, next(self.counter), time.monotonic_ns())
            elif line.startswith("STATUS="):
                try:
                    # In the world-writable beats dir: never write through a name someone planted.
                    write_atomic(self.status_file, line[7:][:1024].encode())
                except OSError:
                    pass
        if self.upstream:
            from ..host.notify import notify

            notify(data.decode("utf-8", "replace"))

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        self.address.unlink(missing_ok=True)
        self.status_file.unlink(missing_ok=True)


UCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid


def sender(ancdata: list[tuple[int, int, bytes]]) -> tuple[int, int] | None:
    """The sender's (pid, uid) from SCM_CREDENTIALS, as the kernel vouches for them; None when absent."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= UCRED.size:
            pid, uid, _gid = UCRED.unpack_from(data)
            return int(pid), int(uid)
    return None


class StderrTee(threading.Thread):
    """Passes the workload's stderr through, keeping the CUDA driver's coredump: lines and, once
    the driver has reported, the Python traceback the program may die of (where the error surfaced)
    and the reporter's word on the dying thread's last CUDA graph replay.

    The lines go to RUNTIME_DIR/driver-logs/UID/PID.log as they come (the user's directory, which
    the daemon made when it admitted the user's registration), for the daemon to put beside the dump
    in the incident.
    """

    KEPT = 5000  # lines at most: a dump of every SM says about 150

    def __init__(self, child: subprocess.Popen[bytes], log_path: Path) -> None:
        super().__init__(name="stderr-tee", daemon=True)
        self.child = child
        self.log_path = log_path
        self.driver_lines: list[str] = []

    def run(self) -> None:
        assert self.child.stderr is not None
        out = sys.stderr.buffer
        log = None
        traceback = 0  # lines of a traceback still to keep
        for raw in iter(self.child.stderr.readline, b""):
            try:
                out.write(raw)
                out.flush()
            except (OSError, ValueError):
                pass
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if self.driver_lines and line == driverlog.TRACEBACK:
                traceback = driverlog.TRACEBACK_LINES
            elif self.driver_lines and line == driverlog.REPLAY_HEADER:
                traceback = driverlog.REPLAY_LINES
            elif traceback:
                traceback = traceback - 1 if line.startswith(" ") else 0  # its last line is the error's
            elif not driverlog.is_driver_line(line):
                continue
            if len(self.driver_lines) >= self.KEPT:
                continue
            self.driver_lines.append(line)
            if log is None:
                log = _open_log(self.log_path)
            if log is not None:
                log.write(line + "\n")
                log.flush()
        if log is not None:
            log.close()


def _open_log(path: Path) -> IO[str] | None:
    """Our own new file in our directory of driver logs: whatever was under the name (a file, a FIFO
    that would block us, a link) is removed first, never written. None where the daemon made no
    directory for us (no daemon runs)."""
    try:
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError:
        return None
    return os.fdopen(fd, "w")


def _report_lost_dump(lines: list[str], dump_dir: Path, pid: int) -> None:
    """The driver reported an exception but wrote no dump: leave its lines where the daemon looks."""
    report = driverlog.parse(lines)
    if report.exception is None or report.dump_file is not None:
        return
    name = f"nodump_{socket.gethostname()}.{pid}.{int(time.time())}{dump_names.DRIVER_LOG_SUFFIX}"
    try:
        write_atomic(dump_dir / name, ("\n".join(lines) + "\n").encode())
    except OSError:
        pass


def exception_fifo(info: Mapping[str, object] | None, base: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """The CUDA_COREDUMP_FILE pattern of the daemon's exception FIFOs for this user's workload, where
    the daemon keeps them and the user set no file of their own (an outer ``hangwatchd run``'s is
    ours too); None otherwise (the workload's dumps are files in the dump dir, as before)."""
    template = info.get("exception_fifo") if info else None
    if not isinstance(template, str) or "{uid}" not in template:
        return None
    mine = template.replace("{uid}", str(os.getuid()))
    chosen = base.get("CUDA_COREDUMP_FILE")
    return mine if chosen in (None, "", mine) else None


def await_fifo(path: str, seconds: float) -> bool:
    """Whether ``path`` is a FIFO within ``seconds`` (the daemon makes it once it admits the
    registration: milliseconds). In the child before exec: a plain poll, no threads."""
    end = time.monotonic() + seconds
    while True:
        try:
            if stat.S_ISFIFO(os.stat(path).st_mode):
                return True
        except OSError:
            pass
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)


def _registered(said_r: int, said_w: int) -> ProcessId | None:
    """The process the child registered before its exec, as it said so (None: it did not)."""
    os.close(said_w)
    try:
        words = os.read(said_r, 256).split()
    except OSError:
        words = []
    finally:
        os.close(said_r)
    try:
        return ProcessId(int(words[0]), int(words[1])) if len(words) == 2 else None
    except ValueError:
        return None


def _forward(child: subprocess.Popen[bytes], sig: int) -> None:
    try:
        child.send_signal(sig)
    except ProcessLookupError:
        pass


def _cleanup(beat_file: Path | None, process: registration_file.ProcessId | None, runtime_dir: Path,
             reports: Path | None = None) -> None:
    if process is not None:
        registration_file.remove(runtime_dir / "registrations", process)
    if beat_file is not None:
        beat_file.unlink(missing_ok=True)
    if reports is not None:
        # Our own 0700 directory: only the job's processes (our user) put anything in it.
        shutil.rmtree(reports, ignore_errors=True)


class LaunchError(Exception):
    pass

