"""The records that move between stages. Frozen: a stage hands them on, never edits them."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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


# -- a job's pace: how fast its steps go, and which rank holds the others back ------------------

PACE_STATES = ("steady", "slower", "slow")  # at its pace (or still learning it); over the margin; a slow episode
MAX_PACE_RANKS = 4096  # ranks in one node's record of a job (a record from the store is refused past it)
MAX_PACE_GPUS = 64
MAX_PACE_TEXT = 300  # characters of a frame or a name kept from a record


@dataclass(frozen=True)
class RankPace:
    """One rank over a window: what its stack samples and its counters say (a node's record of a job
    holds one per rank it watches; ``slow.json`` and the store keep them as written here)."""

    rank: int | None
    pid: int
    node: str
    samples: int = 0  # stack samples read in the window
    collective: int = 0  # ... in which its main thread waited in a collective or a barrier (for the other ranks)
    input: int = 0  # ... waited for its input pipeline (DataLoader or multiprocessing workers)
    gpu: int = 0  # ... waited for its GPU
    running: int = 0  # ... ran Python on a CPU
    frame: str | None = None  # where it ran its own code most often (the innermost frame): "function (file:line)"
    cpu_s: float | None = None  # CPU seconds per step, all its threads
    delay_s: float | None = None  # seconds per step it was ready to run but waited for a CPU (run delay)
    kids_cpu_s: float | None = None  # its children's CPU seconds per step (DataLoader workers, subprocesses)
    kids: int = 0  # children read
    gpu_index: int | None = None  # the GPU it runs on, where NVML says
    frames: tuple[tuple[str, int], ...] = ()  # its own frames in its samples (the function it was in and its callers),
    # with the samples each was in, innermost first: what sets it apart from the other ranks is named from these

    def share(self, count: int) -> float | None:
        return count / self.samples if self.samples else None

    @property
    def wait_share(self) -> float | None:
        """The share of its samples in which it waited in a collective: the rank that holds the others back waits least."""
        return self.share(self.collective)


@dataclass(frozen=True)
class GpuPace:
    """One GPU over the window: the NVML facts that slow a rank down (None where NVML could not say)."""

    index: int
    uuid: str | None = None
    sm_clock_ratio: float | None = None  # the lowest SM clock seen against the GPU's max
    throttle: tuple[str, ...] = ()  # clock throttle reasons seen (idle and the application's own clocks left out)
    power_ratio: float | None = None  # the highest power draw seen against the enforced limit
    temperature_c: float | None = None  # the highest temperature seen
    ecc_errors: int | None = None  # volatile ECC errors that appeared in the window
    pcie_replays: int | None = None  # PCIe replays in the window
    nvlink_errors: int | None = None  # NVLink replay, recovery and CRC errors in the window
    processes: tuple[tuple[int, int], ...] = ()  # (pid, highest SM %) of every process NVML sampled on it


@dataclass(frozen=True)
class JobPace:
    """One node's record of a job's pace: its step time, its baseline, and each of its ranks here."""

    job: str
    uid: int | None
    node: str
    time: float  # wall clock, when it was made
    step_s: float | None  # seconds a step now (the median of its ranks here)
    baseline_s: float | None  # its own pace, learned from its steady steps
    state: str = "steady"  # one of PACE_STATES
    since: float | None = None  # wall clock: when it went over the margin (slower, slow)
    window_s: float = 0.0  # seconds of samples and counters the ranks' figures cover
    ranks: tuple[RankPace, ...] = ()
    gpus: tuple[GpuPace, ...] = ()
    named_rank: int | None = None  # slow: the rank this node found holding the job back when its episode began
    named_node: str | None = None  # ... and that rank's node

    @property
    def slower_by(self) -> float | None:
        """How much slower than its baseline, as a fraction (0.25: 25 % slower)."""
        if self.step_s is None or not self.baseline_s:
            return None
        return self.step_s / self.baseline_s - 1.0


def pace_to_dict(p: JobPace) -> dict[str, Any]:
    return dataclasses.asdict(p)


def pace_from_dict(d: Any) -> JobPace:
    """A node's record read back (from the store, or a slow.json put together by hand): every field
    checked and bounded; ValueError (one line) for anything that is not such a record."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    ranks = d.get("ranks") or []
    gpus = d.get("gpus") or []
    if not isinstance(ranks, list) or len(ranks) > MAX_PACE_RANKS:
        raise ValueError(f"ranks is not a list of at most {MAX_PACE_RANKS}")
    if not isinstance(gpus, list) or len(gpus) > MAX_PACE_GPUS:
        raise ValueError(f"gpus is not a list of at most {MAX_PACE_GPUS}")
    state = d.get("state", "steady")
    if state not in PACE_STATES:
        raise ValueError(f"state {str(state)[:40]!r} is not one of {', '.join(PACE_STATES)}")
    return JobPace(_text(d.get("job"), "job", required=True) or "", _int(d.get("uid"), "uid"),
                   _text(d.get("node"), "node", required=True) or "", _num(d.get("time"), "time") or 0.0,
                   _num(d.get("step_s"), "step_s"), _num(d.get("baseline_s"), "baseline_s"), state,
                   _num(d.get("since"), "since"), _num(d.get("window_s"), "window_s") or 0.0,
                   tuple(_rank(r) for r in ranks), tuple(_gpu(g) for g in gpus), _int(d.get("named_rank"), "named_rank"),
                   _text(d.get("named_node"), "named_node"))


def _rank(d: Any) -> RankPace:
    if not isinstance(d, dict):
        raise ValueError("a rank is not a JSON object")
    counts = {k: _int(d.get(k), k) or 0 for k in ("samples", "collective", "input", "gpu", "running", "kids")}
    if any(v < 0 for v in counts.values()) or any(counts[k] > counts["samples"] for k in ("collective", "input", "gpu", "running")):
        raise ValueError("a rank's sample counts are negative or more than its samples")
    pid = _int(d.get("pid"), "pid")
    if pid is None:
        raise ValueError("a rank has no pid")
    frames = d.get("frames") or []
    if not isinstance(frames, list) or len(frames) > 64:
        raise ValueError("a rank's frames are not a short list")
    pairs = []
    for f in frames:
        if not isinstance(f, (list, tuple)) or len(f) != 2:
            raise ValueError("a rank's frame is not [frame, samples]")
        n = _int(f[1], "a frame's samples")
        if n is None or not 0 <= n <= counts["samples"]:
            raise ValueError("a rank's frame has more samples than the rank")
        pairs.append((_text(f[0], "frame", required=True) or "", n))
    return RankPace(_int(d.get("rank"), "rank"), pid, _text(d.get("node"), "node", required=True) or "",
                    frame=_text(d.get("frame"), "frame"), cpu_s=_num(d.get("cpu_s"), "cpu_s"),
                    delay_s=_num(d.get("delay_s"), "delay_s"), kids_cpu_s=_num(d.get("kids_cpu_s"), "kids_cpu_s"),
                    gpu_index=_int(d.get("gpu_index"), "gpu_index"), frames=tuple(pairs), **counts)


def _gpu(d: Any) -> GpuPace:
    if not isinstance(d, dict):
        raise ValueError("a GPU is not a JSON object")
    index = _int(d.get("index"), "index")
    if index is None:
        raise ValueError("a GPU has no index")
    throttle = d.get("throttle") or []
    procs = d.get("processes") or []
    if not isinstance(throttle, list) or len(throttle) > 16 or not isinstance(procs, list) or len(procs) > MAX_PACE_RANKS:
        raise ValueError("a GPU's throttle reasons or processes are not short lists")
    pairs = []
    for p in procs:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ValueError("a GPU's process is not [pid, SM %]")
        pid, sm = _int(p[0], "pid"), _int(p[1], "SM %")
        if pid is None or sm is None:
            raise ValueError("a GPU's process is not [pid, SM %]")
        pairs.append((pid, sm))
    return GpuPace(index, _text(d.get("uuid"), "uuid"), _num(d.get("sm_clock_ratio"), "sm_clock_ratio"),
                   tuple(_text(t, "throttle reason", required=True) or "" for t in throttle),
                   _num(d.get("power_ratio"), "power_ratio"), _num(d.get("temperature_c"), "temperature_c"),
                   _int(d.get("ecc_errors"), "ecc_errors"), _int(d.get("pcie_replays"), "pcie_replays"),
                   _int(d.get("nvlink_errors"), "nvlink_errors"), tuple(pairs))


def _text(v: Any, what: str, required: bool = False) -> str | None:
    if v is None and not required:
        return None
    if not isinstance(v, str) or (required and not v):
        raise ValueError(f"{what} is not a string")
    return v[:MAX_PACE_TEXT]


def _int(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 2**53:
        raise ValueError(f"{what} is not a whole number")
    return v


def _num(v: Any, what: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > 1e12:
        raise ValueError(f"{what} is not a finite number")
    return float(v)
