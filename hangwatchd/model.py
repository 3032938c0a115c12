"""The records that move between stages. Frozen: a stage hands them on, never edits them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the records stay free of the host's imports at run time
    from .host.untrusted import UserFile


@dataclass(frozen=True, order=True)
class ProcessId:
    """A process is (pid, start time in clock ticks since boot); a bare pid can be reused."""

    pid: int
    start_time: int

    def __str__(self) -> str:
        return f"{self.pid}@{self.start_time}"


@dataclass(frozen=True)
class Registration:
    """What a launcher or a workload told us about a process it wants watched."""

    process: ProcessId
    uid: int
    job: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    heartbeat_timeout: float | None = None
    stack_timeout: float | None = None  # declared: the stack must change within this many seconds
    beat_file: str | None = None
    status_file: str | None = None  # where hangwatchd run keeps the workload's sd_notify STATUS=
    cmdline: tuple[str, ...] = ()
    source: str = "run"
    registered_at: float = 0.0
    ras_addr: str | None = None  # the job's NCCL RAS service (NCCL_RAS_ADDR), as hangwatchd run gave it
    role: str = "workload"  # "launcher": torchrun and the like, watched for its exit, never for beats
    launcher: int | None = None  # a rank that registered itself: the pid of the launched process above it
    on_hang: str | None = None  # "report" or "abort", the job owner's choice (hangwatchd run --on-hang); None: the config's
    # Where the daemon reads beat_file and status_file: resolved once when the registration was
    # admitted (a trusted directory's descriptor and a base name), never looked up by path again.
    beat_at: UserFile | None = field(default=None, compare=False)
    status_at: UserFile | None = field(default=None, compare=False)


def is_job_mate(of: Registration, other: Registration, role: str | None = None) -> bool:
    """Whether ``other`` is a rank of ``of``'s job: a job is (owner uid, job name), so another
    user's process under the same name never is, nor is a process without a job, nor a launcher
    (``role``: what the daemon has learned of ``other``'s role, where it knows more than the
    registration says). The one definition of a job-mate: every caller asks here."""
    return (of.job is not None and other.job == of.job and other.uid == of.uid
            and (role or other.role) != "launcher")


def in_job(reg: Registration, job: str, uid: int | None, role: str | None = None) -> bool:
    """Whether ``reg`` is a rank of user ``uid``'s job ``job`` (``uid`` None: a request from a daemon
    older than per-owner requests, which named no owner), by the same rule as ``is_job_mate``."""
    return reg.job == job and (uid is None or reg.uid == uid) and (role or reg.role) != "launcher"


class State(str, enum.Enum):
    STARTING = "starting"  # registered, no beat seen yet
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # one signal says stalled; confirming before anything is done
    HUNG = "hung"  # confirmed: capture under way
    CAPTURED = "captured"  # evidence stored; we do not capture the same hang twice
    EXITED = "exited"


@dataclass(frozen=True)
class Suspicion:
    """A detector's finding: this process stopped making progress."""

    reason: str  # "heartbeat", "stack", ...
    detail: str
    since: float  # wall-clock time of the last sign of progress
    signals: tuple[str, ...] = ()  # every signal that agreed, e.g. ("heartbeat", "stack")


@dataclass(frozen=True)
class StepResult:
    """One capture step on one process: what it produced and how it went."""

    step: str
    ok: bool
    seconds: float
    error: str | None = None
    files: tuple[str, ...] = ()
    skipped: bool = False
    not_applicable: bool = False  # nothing to capture here; ``error`` says why (shown as n/a)


@dataclass(frozen=True)
class ProcessCapture:
    registration: Registration
    steps: tuple[StepResult, ...]


@dataclass(frozen=True)
class Incident:
    id: str
    time: float
    host: str
    reason: str
    detail: str
    job: str | None
    processes: tuple[ProcessCapture, ...] = field(default_factory=tuple)
    complete: bool = True
    verdict: str | None = None
    signals: tuple[str, ...] = ()
    notify_status: str | None = None  # the workload's last sd_notify STATUS=
    since: float | None = None  # wall-clock time of the hung process's last sign of progress
    node: str | None = None  # the node's name (config node_name), as in the shared store
    job_incident: str | None = None  # shared by every node's part of one job hang
    # Evidence still coming after the incident was stored (flight recorders, GPU dumps): each
    # {"pid", "step", "until"} (wall-clock deadline); emptied as each arrives or passes its deadline.
    pending: tuple[PendingEvidence, ...] = ()


@dataclass(frozen=True)
class PendingEvidence:
    """One capture step of one process, still running after its incident was stored."""

    pid: int
    step: str
    until: float  # wall-clock time by which it has come or is marked as never come
