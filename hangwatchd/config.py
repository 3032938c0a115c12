"""The daemon's settings: defaults, the TOML file, flags on top, and validation.

Every key is declared once, as a field of ``Config`` (``key``: its default, its
check and the line that documents it); ``KEYS`` is read from those fields, and
``config/hangwatchd.toml`` is tested against it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_RUNTIME_DIR = "/run/hangwatchd"
RUNTIME_DIR_ENV = "HANGWATCHD_RUNTIME_DIR"


class ConfigError(Exception):
    """A setting is wrong: the message names the key, the value and what is allowed."""


class Invalid(ValueError):
    """A value a key does not allow; the message says what it allows."""


@dataclass(frozen=True)
class Key:
    default: Any
    parse: Callable[[Any], Any]  # the value as the daemon uses it; raises Invalid(what is allowed)
    doc: str

    def check(self, value: Any) -> str | None:
        """What is allowed, when ``value`` is not; None when it is."""
        try:
            self.parse(value)
        except Invalid as exc:
            return str(exc)
        return None


def _number(v: Any) -> float | None:
    """A finite int or float (not a bool), else None: inf and nan are never a setting."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return v


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# systemd's convention: K, M, G, T count in 1024s like KiB..TiB; KB, MB, GB, TB in 1000s.
_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
               "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def _quantity(v: Any, units: Mapping[str, float], default_unit: str) -> float | None:
    """A plain number (in ``default_unit``) or a string like "10m" / "50GiB"; None when neither."""
    n = _number(v)
    if n is not None:
        return float(n)
    if not isinstance(v, str):
        return None
    m = _QUANTITY.fullmatch(v)
    if not m:
        return None
    unit = m.group(2).lower() or default_unit
    if unit not in units:
        return None
    value = float(m.group(1)) * units[unit]
    return value if math.isfinite(value) else None


def parse_duration(v: Any, per: float = 1.0, what: str = "seconds") -> float:
    """Seconds (or days, with ``per=86400``) from 30, 2.5, "500ms", "10m", "1.5h", "7d"."""
    secs = _quantity(v, {k: u / per for k, u in _DURATION_UNITS.items()} | {"": 1.0}, "")
    if secs is None or secs <= 0:
        raise Invalid(f"a number of {what} greater than 0, or a duration with a unit "
                      "(\"500ms\", \"30s\", \"10m\", \"2h\", \"7d\")")
    return secs


def parse_size(v: Any) -> int:
    """Bytes from 1073741824, "50GiB", "10G" (1024-based, as systemd), "500MB" (1000-based)."""
    n = _quantity(v, _SIZE_UNITS, "")
    if n is None or n < 1:
        raise Invalid("a size in bytes greater than 0, or with a unit (\"500MiB\", \"50GiB\", \"10G\", \"2TB\")")
    return int(n)


def _seconds(v: Any) -> float:
    return parse_duration(v)


def _days(v: Any) -> float:
    return parse_duration(v, per=86400.0, what="days")


def _factor(v: Any) -> float:
    n = _number(v)
    if n is None or n <= 0:
        raise Invalid("a number greater than 0")
    return float(n)


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise Invalid("a whole number greater than 0")
    return v


def _megabytes(v: Any) -> int:
    # At least what an interpreter with the symboliser loaded needs to start.
    if isinstance(v, bool) or not isinstance(v, int) or v < 256:
        raise Invalid("a whole number of MB, at least 256")
    return v


def _path(v: Any) -> str:
    if isinstance(v, str) and v and "\0" not in v:
        return v
    raise Invalid("a non-empty path")


def _optional_path(v: Any) -> str:
    if isinstance(v, str) and "\0" not in v:
        return v
    raise Invalid("a path, or \"\" for the default")


def _address(v: Any) -> str:
    if v == "":
        return v
    if isinstance(v, str) and ":" in v:
        host, _, port = v.rpartition(":")
        if port.isdigit() and 0 <= int(port) < 65536 and not any(c.isspace() or c in "/\0" for c in host):
            return v
    raise Invalid("HOST:PORT (port 0 picks a free one), or \"\" to serve no metrics")


def _one_of(*allowed: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if v in allowed:
            return str(v)
        raise Invalid("one of " + ", ".join(allowed))
    return parse


STEP_NAMES = ("proc", "progress", "pyspy", "children", "exits", "introspect", "nvml", "nccl_ras", "flight_recorder",
              "cuda_dump")


def _steps(v: Any) -> tuple[str, ...]:
    if isinstance(v, list) and v and all(s in STEP_NAMES for s in v) and len(set(v)) == len(v):
        return tuple(v)
    raise Invalid("a list of capture steps without repeats, from: " + ", ".join(STEP_NAMES))


def _store_url(v: Any) -> str:
    if v == "":
        return v
    from .fleet.url import (  # the URL's own rules, kept beside the code that uses them
        StoreURLError,
        parse,
    )

    try:
        parse(v)
    except StoreURLError:
        raise Invalid("s3://BUCKET/PREFIX, or \"\" for no shared store") from None
    return str(v)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise Invalid("true or false")


def _optional_regex(v: Any) -> str:
    return "" if v == "" else _regex(v)


def _regex(v: Any) -> str:
    try:
        re.compile(v)
    except (re.error, TypeError):
        raise Invalid("a regular expression") from None
    return str(v)


def _regex_list(v: Any) -> tuple[str, ...]:
    try:
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return tuple(_regex(x) for x in v)
    except Invalid:
        pass
    raise Invalid("a list of regular expressions")


def _timeouts_by_command(v: Any) -> dict[str, float]:
    allowed = "a table of command-line regular expression = seconds greater than 0 (or a duration like \"10m\")"
    if not isinstance(v, dict):
        raise Invalid(allowed)
    try:
        return {_regex(k): parse_duration(t) for k, t in v.items()}
    except Invalid:
        raise Invalid(allowed) from None


def key(default: Any, parse: Callable[[Any], Any], doc: str) -> Any:
    """One setting, declared once: its default as the TOML file writes it, the check that turns a
    value into what the daemon uses (``Invalid`` when it is not allowed), and the line that documents
    it. The field's own default is the parsed one."""
    value = parse(default)
    spec = {"key": Key(default, parse, doc)}
    if isinstance(value, (dict, list)):
        return dataclasses.field(default_factory=lambda: parse(default), metadata=spec)
    return dataclasses.field(default=value, metadata=spec)


@dataclass(frozen=True)
class Config:
    state_dir: str = key("/var/lib/hangwatchd", _path, "incidents and their index")
    runtime_dir: str = key(DEFAULT_RUNTIME_DIR, _path, "registrations, heartbeat segments, pipes; clients find it through $HANGWATCHD_RUNTIME_DIR")
    dump_dir: str = key("", _optional_path, "where CUDA writes coredumps (world-writable); \"\" means STATE_DIR-dumps, beside the state dir, never in it")
    metrics_address: str = key("0.0.0.0:9842", _address, "where Prometheus scrapes /metrics; \"\" serves none")
    heartbeat_timeout: float = key(120.0, _seconds, "seconds without a beat before a process is hung, when it registered none of its own")
    startup_grace: float = key(600.0, _seconds, "seconds a registered process may take to send its first beat; one that declared no heartbeat timeout and sends"
        " none is then watched by its stack, never hung for it")
    exited_keep: float = key(600.0, _seconds, "seconds the daemon keeps what it knew of an exited process, for its job-mates' incidents")
    rescan_interval: float = key(30.0, _seconds, "seconds between full rescans of the registrations (inotify is the fast path)")
    capture_steps: tuple[str, ...] = key(list(STEP_NAMES), _steps, "capture steps to run on a hung process, in order (cuda_dump is always last)")
    capture_timeout: float = key(60.0, _seconds, "seconds the whole capture of one process may take")
    exit_window: float = key(600.0, _seconds, "seconds back from a capture whose exits of the hung process's descendants "
        "(with their exit status or signal) go into its exits.json; the daemon records exits as root")
    pyspy_timeout: float = key(10.0, _seconds, "seconds one py-spy dump may take before it is killed")
    pyspy_native: bool = key(True, _bool, "also take native (C/C++/CUDA) frames with py-spy --native")
    learn_timeouts: bool = key(True, _bool, "learn a process's heartbeat timeout from its beats when it declared none")
    learned_timeout_factor: float = key(10.0, _factor, "a learned timeout is this many times the longest recent beat interval")
    learned_timeout_min: float = key(5.0, _seconds, "the shortest learned timeout, in seconds")
    learned_timeout_max: float = key(1800.0, _seconds, "the longest learned timeout, in seconds")
    learn_min_beats: int = key(20, _count, "beat intervals seen before a timeout is learned")
    stack_interval: float = key(5.0, _seconds, "seconds between py-spy samples of a process watched by its stack")
    stack_window: float = key(120.0, _seconds, "seconds a stack must hold to count as frozen, where the process declared no stack timeout")
    stack_timeouts: dict[str, float] = key({}, _timeouts_by_command,
                                           "stack timeouts by command line: { \"regex\" = seconds }, like hangwatchd run --stack-timeout")
    stack_blocking_patterns: tuple[str, ...] = key([], _regex_list, "extra frame patterns that mean 'blocked, waiting for something that should come'")
    stack_idle_pattern: str = key("", _optional_regex, "frame pattern that means 'idle, waiting for work' (\"\" keeps the built-in one)")
    slow_jobs: bool = key(True, _bool, "watch each job's pace from its ranks' beats: a job slower than its learned baseline for "
        "slow_for gets one slow incident (stacks and NVML only) naming the rank that holds it back, and why")
    slow_margin: float = key(0.15, _factor, "a job is slower when its step time is this fraction above its learned baseline (0.15: 15 %)")
    slow_for: float = key(60.0, _seconds, "seconds a job stays slower before it is a slow episode (an incident); it ends once back "
        "within half the margin")
    slow_sample_interval: float = key(10.0, _seconds, "seconds between stack samples of one rank for its wait share (py-spy "
        "--nonblocking, the job's ranks in turn: one sample per rank per interval; five per interval while the job is slower)")
    slow_window: float = key(300.0, _seconds, "seconds of samples and counters a rank's wait share and CPU per step are "
        "taken over (from when the job went over its margin, once it has)")
    slow_publish_interval: float = key(30.0, _seconds, "seconds between this node's records of its jobs' pace in the "
        "shared store (store), which the other nodes read while one of their jobs is slower")
    discover: bool = key(False, _bool, "also watch, by stack alone, every process that holds /dev/nvidia* open")
    discover_interval: float = key(1.0, _seconds, "seconds between looks for new GPU processes (new pids' fds, and NVML's process lists)")
    discover_devices: str = key("/dev/nvidia", _path, "path prefix of the GPU device files: discovery watches their holders; "
        "GPU dumps of one file's holders are "
        "triggered one at a time")
    introspect_timeout: float = key(2.0, _seconds, "seconds to wait for the report of a process's in-process reporter "
        "(what each thread waits on and holds; hangwatchd run installs it)")
    nvml_timeout: float = key(10.0, _seconds, "seconds the NVML probe may take before it is killed")
    kernel_log: str = key("/dev/kmsg", _optional_path, "the kernel log the daemon follows for NVRM Xid lines, which name "
        "the process behind each GPU fault (reading /dev/kmsg needs root); \"\" reads none: XIDs then come from NVML alone, "
        "without their process, and an application's XID is never taken for another process's fault")
    suspect_jobs: int = key(2, _count, "different jobs whose incidents implicate one GPU of this node, within suspect_window, "
        "that make hangwatchd health report a node problem (the ledger of suspects: hangwatchd suspects)")
    suspect_window: float = key(86400.0, _seconds, "seconds back that the incidents implicating a GPU count towards suspect_jobs")
    nccl_ras_timeout: float = key(3.0, _seconds, "seconds to wait for the answer of the job's NCCL RAS service (it answers in ms)")
    flight_recorder_timeout: float = key(20.0, _seconds, "seconds to wait for PyTorch's flight recorder dump")
    flight_recorder_warmup: bool = key(True, _bool, "ask each rank's flight recorder as it starts (again while its trace is empty), so "
        "PyTorch's first-dump import (torch._inductor, seconds in eager mode) is paid then, not in "
        "the capture of a hang")
    gpu_dump: str = key("confirmed", _one_of("always", "confirmed", "never"),
        "take a CUDA coredump of a hung process started by hangwatchd run; the dump ENDS the process: "
        "always, never (keeps hung processes running), or when confirmed (the heartbeat and the stack "
        "agree, or its native stack waits on the GPU or a collective), whatever on_hang says")
    gpu_dump_timeout: float = key(120.0, _seconds, "seconds to wait for the driver to finish writing a CUDA coredump")
    exception_fifos: bool = key(True, _bool, "hangwatchd run points the driver's GPU exception dumps at a FIFO the daemon makes for "
        "each process (DUMP_DIR/exceptions/UID/), so the process's stacks are taken while it still waits where the error "
        "surfaced, before the dump is read; false: the dumps are files in dump_dir, found after the process is gone")
    exception_dump_max_bytes: int = key(8 << 30, parse_size, "bytes of one GPU exception dump read from its FIFO "
        "(\"8GiB\"); past it the reading stops, the incident says so, and the driver's write fails")
    symbolize_cpu_seconds: float = key(30.0, _seconds, "CPU seconds the child that symbolises one GPU dump may use before it is killed")
    symbolize_memory_mb: int = key(4096, _megabytes, "address space, in MB, of the child that symbolises one GPU dump (the dump is mapped into it)")
    symbolize_timeout: float = key(60.0, _seconds, "seconds the child that symbolises one GPU dump may take before it is killed")
    max_state_bytes: int = key(50 * 2**30, parse_size,
                               "the state dir's size bound (\"50GiB\", \"500MB\" or bytes): oldest dumps go first, then oldest incidents")
    dump_max_age_days: float = key(7.0, _days, "raw GPU dumps older than this are deleted (their reports are kept)")
    incident_max_age_days: float = key(90.0, _days, "incidents older than this are deleted, report and index entry too")
    retention_interval: float = key(600.0, _seconds, "seconds between retention passes (one also at start, and as soon "
        "as new incidents take the state dir past max_state_bytes)")
    max_registrations_per_uid: int = key(64, _count, "processes one non-root user may have watched at once; more registrations are refused")
    pyspy_samples_per_uid: float = key(4.0, _factor, "py-spy samples per second the daemon takes of one non-root user's processes (bursts of 2 s worth)")
    captures_per_uid: int = key(1, _count, "captures (hangs and dumps) of one non-root user's processes in flight at once; more wait")
    capture_seconds_per_uid: float = key(600.0, _seconds, "seconds of capture one non-root user's processes may use per hour; past it their hangs wait")
    dumps_per_uid_per_minute: int = key(6, _count, "exception dumps of one non-root user ingested per minute; more are refused and counted")
    incidents_per_uid_per_minute: int = key(6, _count, "incidents filed for one non-root user per minute; more are refused and counted")
    spool_bytes_per_uid: int = key(64 << 20, parse_size, "bytes of one non-root user's reports kept in the full-disk spool (\"64MiB\")")
    log_lines_per_uid_per_minute: int = key(60, _count, "log lines about one non-root user's files per minute; the rest are counted, not written")
    store: str = key("", _store_url, "shared S3-compatible store for job incidents across nodes, s3://BUCKET/PREFIX "
        "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ..., or a role); \"\" for none")
    node_name: str = key("", _optional_path, "this node's name in the store, records and metrics; \"\" means the host name")
    store_poll_interval: float = key(2.0, _seconds, "seconds between polls of the store for capture requests, per watched job")
    store_spool_max: int = key(1000, _count, "uploads kept queued on disk while the store is down (the oldest dropped first)")
    job_incident_window: float = key(300.0, _seconds, "seconds during which a job's hang reported by any node is the same job incident")
    on_hang: str = key("report", _one_of("report", "abort"),
        "after a hang's incident is stored: report (send no signal; a GPU dump, see gpu_dump, still ends "
        "the process it dumps) or abort (SIGABRT its ranks on this node, SIGKILL after abort_grace); a "
        "job's own hangwatchd run --on-hang wins")
    abort_grace: float = key(10.0, _seconds, "seconds between SIGABRT and SIGKILL when a hung job is aborted")
    abort_on_request: bool = key(False, _bool, "also end a job's ranks here (those whose policy is abort) when another node "
        "declared the job hung, through the store, though they look healthy here; off: only "
        "this node's own judgement ends a process (anyone with the store's keys can write a request)")
    log_format: str = key("json", _one_of("json", "console"), "json: one JSON object a line; console: for a person")
    log_level: str = key("info", _one_of("debug", "info", "warning", "error"), "the least severe events logged")

    @property
    def dumps(self) -> Path:
        """Where CUDA writes dumps: any user writes there, so it is never inside the state dir
        (whose size retention bounds, and whose files are root's)."""
        if self.dump_dir:
            return Path(self.dump_dir)
        state = Path(self.state_dir)
        return state.with_name(state.name + "-dumps")

    @property
    def node(self) -> str:
        return self.node_name or os.environ.get("NODE_NAME") or socket.gethostname()

    @property
    def registrations(self) -> Path:
        return Path(self.runtime_dir) / "registrations"

    @property
    def beats(self) -> Path:
        return Path(self.runtime_dir) / "beats"

    @property
    def driver_logs(self) -> Path:
        return Path(self.runtime_dir) / "driver-logs"


# Every key by name, read from Config's fields (each declared there once).
KEYS: dict[str, Key] = {f.name: f.metadata["key"] for f in dataclasses.fields(Config)}


def _validate(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in KEYS:
            near = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"did you mean '{near[0]}'?" if near else "config/hangwatchd.toml lists every key with its default"
            raise ConfigError(f"{where}: unknown key '{key}'; {hint}")
        try:
            out[key] = KEYS[key].parse(value)
        except Invalid as exc:
            raise ConfigError(f"{where}: key '{key}' = {value!r} is not allowed; expected {exc}") from None
    return out


def _check_together(cfg: Config, where: str) -> None:
    """Rules between keys, after the file and the flags are merged."""
    if cfg.learned_timeout_min > cfg.learned_timeout_max:
        raise ConfigError(f"{where}: learned_timeout_min = {cfg.learned_timeout_min:g} s is more than "
                          f"learned_timeout_max = {cfg.learned_timeout_max:g} s; make the minimum at most the maximum")


def load(path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Defaults, then the file, then flags (``overrides``; None values are ignored)."""
    values: dict[str, Any] = {}
    if path is not None:
        import tomllib  # here: the job side (hangwatchd run) imports this module on Python 3.9, which has none

        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config {p}: no such file") from None
        except PermissionError:
            raise ConfigError(f"config {p}: permission denied") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config {p}: not valid TOML ({exc})") from None
        values.update(_validate(raw, f"config {p}"))
    if overrides:
        values.update(_validate({k: v for k, v in overrides.items() if v is not None}, "command line"))
    cfg = dataclasses.replace(Config(), **values)
    _check_together(cfg, f"config {path}" if path is not None else "command line")
    return cfg


def client_runtime_dir() -> Path:
    """Where a workload looks for the daemon."""
    return Path(os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)
