"""The daemon's settings: defaults, the TOML file, flags on top, and validation.

Every key lives in ``KEYS`` once, with its default, its check and the line
that documents it; ``config/hangwatchd.toml`` is tested against this table.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_RUNTIME_DIR = "/run/hangwatchd"
RUNTIME_DIR_ENV = "HANGWATCHD_RUNTIME_DIR"


class ConfigError(Exception):
    """A setting is wrong: the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class Key:
    default: Any
    check: Callable[[Any], str | None]  # returns what is allowed when the value is not
    doc: str


def _positive(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
    return None if ok else "a number of seconds greater than 0"


def _path(v: Any) -> str | None:
    return None if isinstance(v, str) and v and "\0" not in v else "a non-empty path"


def _optional_path(v: Any) -> str | None:
    return None if isinstance(v, str) and "\0" not in v else "a path, or \"\" for the default"


def _address(v: Any) -> str | None:
    if v == "":
        return None
    if isinstance(v, str) and ":" in v:
        host, _, port = v.rpartition(":")
        if port.isdigit() and 0 <= int(port) < 65536:
            return None
    return "HOST:PORT (port 0 picks a free one), or \"\" to serve no metrics"


def _one_of(*allowed: str) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in allowed else "one of " + ", ".join(allowed)
    return check


STEP_NAMES = ("proc", "progress", "pyspy", "nvml", "flight_recorder", "cuda_dump")


def _steps(v: Any) -> str | None:
    from_known = STEP_NAMES
    if isinstance(v, list) and v and all(s in from_known for s in v) and len(set(v)) == len(v):
        return None
    return "a list of capture steps without repeats, from: " + ", ".join(from_known)


def _store_url(v: Any) -> str | None:
    if v == "":
        return None
    from .fleet.url import StoreURLError, parse

    try:
        parse(v)
    except StoreURLError:
        return "s3://BUCKET/PREFIX, or \"\" for no shared store"
    return None


def _count(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v > 0 else "a whole number greater than 0"


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def _optional_regex(v: Any) -> str | None:
    return None if v == "" else _regex(v)


def _regex(v: Any) -> str | None:
    import re

    try:
        re.compile(v)
    except (re.error, TypeError):
        return "a regular expression"
    return None


def _regex_list(v: Any) -> str | None:
    ok = isinstance(v, list) and all(isinstance(x, str) and _regex(x) is None for x in v)
    return None if ok else "a list of regular expressions"


def _timeouts_by_command(v: Any) -> str | None:
    ok = isinstance(v, dict) and all(_regex(k) is None and _positive(t) is None for k, t in v.items())
    return None if ok else "a table of command-line regular expression = seconds greater than 0"


KEYS: dict[str, Key] = {
    "state_dir": Key("/var/lib/hangwatchd", _path, "incidents and their index"),
    "runtime_dir": Key(DEFAULT_RUNTIME_DIR, _path, "registrations, heartbeat segments, pipes; clients find it through $HANGWATCHD_RUNTIME_DIR"),
    "dump_dir": Key("", _optional_path, "where CUDA writes coredumps; \"\" means STATE_DIR/dumps"),
    "metrics_address": Key("0.0.0.0:9842", _address, "where Prometheus scrapes /metrics; \"\" serves none"),
    "heartbeat_timeout": Key(120.0, _positive, "seconds without a beat before a process is hung, when it registered none of its own"),
    "startup_grace": Key(600.0, _positive, "seconds a registered process may take to send its first beat"),
    "rescan_interval": Key(30.0, _positive, "seconds between full rescans of the registrations (inotify is the fast path)"),
    "capture_steps": Key(list(STEP_NAMES), _steps, "capture steps to run on a hung process, in order (cuda_dump is always last)"),
    "capture_timeout": Key(60.0, _positive, "seconds the whole capture of one process may take"),
    "pyspy_timeout": Key(10.0, _positive, "seconds one py-spy dump may take before it is killed"),
    "pyspy_native": Key(True, _bool, "also take native (C/C++/CUDA) frames with py-spy --native"),
    "learn_timeouts": Key(True, _bool, "learn a process's heartbeat timeout from its beats when it declared none"),
    "learned_timeout_factor": Key(10.0, _positive, "a learned timeout is this many times the longest recent beat interval"),
    "learned_timeout_min": Key(5.0, _positive, "the shortest learned timeout, in seconds"),
    "learned_timeout_max": Key(1800.0, _positive, "the longest learned timeout, in seconds"),
    "learn_min_beats": Key(20, _positive, "beat intervals seen before a timeout is learned"),
    "stack_interval": Key(5.0, _positive, "seconds between py-spy samples of a process watched by its stack"),
    "stack_window": Key(120.0, _positive, "seconds a stack must hold to count as frozen, where the process declared no stack timeout"),
    "stack_timeouts": Key({}, _timeouts_by_command, "stack timeouts by command line: { \"regex\" = seconds }, like hangwatchd run --stack-timeout"),
    "stack_blocking_patterns": Key([], _regex_list, "extra frame patterns that mean 'blocked, waiting for something that should come'"),
    "stack_idle_pattern": Key("", _optional_regex, "frame pattern that means 'idle, waiting for work' (\"\" keeps the built-in one)"),
    "discover": Key(False, _bool, "also watch, by stack alone, every process that holds /dev/nvidia* open"),
    "nvml_timeout": Key(10.0, _positive, "seconds the NVML probe may take before it is killed"),
    "flight_recorder_timeout": Key(20.0, _positive, "seconds to wait for PyTorch's flight recorder dump"),
    "gpu_dump": Key("confirmed", _one_of("always", "confirmed", "never"),
                    "take a CUDA coredump of a hung process (it ends the process): always, never, or when "
                    "confirmed (its native stack waits on the GPU or a collective, or you asked)"),
    "gpu_dump_timeout": Key(120.0, _positive, "seconds to wait for the driver to finish writing a CUDA coredump"),
    "max_state_bytes": Key(50 * 2**30, _positive, "the state dir's size bound: oldest dumps go first, then oldest incidents"),
    "dump_max_age_days": Key(7.0, _positive, "raw GPU dumps older than this are deleted (their reports are kept)"),
    "incident_max_age_days": Key(90.0, _positive, "incidents older than this are deleted, report and index entry too"),
    "store": Key("", _store_url, "shared S3-compatible store for job incidents across nodes, s3://BUCKET/PREFIX "
                  "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ..., or a role); \"\" for none"),
    "node_name": Key("", _optional_path, "this node's name in the store, records and metrics; \"\" means the host name"),
    "store_poll_interval": Key(2.0, _positive, "seconds between polls of the store for capture requests, per watched job"),
    "store_spool_max": Key(1000, _count, "uploads kept queued on disk while the store is down (the oldest dropped first)"),
    "job_incident_window": Key(300.0, _positive, "seconds during which a job's hang reported by any node is the same job incident"),
    "log_format": Key("json", _one_of("json", "console"), "json: one JSON object a line; console: for a person"),
    "log_level": Key("info", _one_of("debug", "info", "warning", "error"), "the least severe events logged"),
}


@dataclass(frozen=True)
class Config:
    state_dir: str = KEYS["state_dir"].default
    runtime_dir: str = KEYS["runtime_dir"].default
    dump_dir: str = KEYS["dump_dir"].default
    metrics_address: str = KEYS["metrics_address"].default
    heartbeat_timeout: float = KEYS["heartbeat_timeout"].default
    startup_grace: float = KEYS["startup_grace"].default
    rescan_interval: float = KEYS["rescan_interval"].default
    capture_steps: tuple[str, ...] = tuple(KEYS["capture_steps"].default)
    capture_timeout: float = KEYS["capture_timeout"].default
    pyspy_timeout: float = KEYS["pyspy_timeout"].default
    pyspy_native: bool = KEYS["pyspy_native"].default
    learn_timeouts: bool = KEYS["learn_timeouts"].default
    learned_timeout_factor: float = KEYS["learned_timeout_factor"].default
    learned_timeout_min: float = KEYS["learned_timeout_min"].default
    learned_timeout_max: float = KEYS["learned_timeout_max"].default
    learn_min_beats: int = KEYS["learn_min_beats"].default
    stack_interval: float = KEYS["stack_interval"].default
    stack_window: float = KEYS["stack_window"].default
    stack_timeouts: dict[str, float] = dataclasses.field(default_factory=dict)
    stack_blocking_patterns: tuple[str, ...] = ()
    stack_idle_pattern: str = KEYS["stack_idle_pattern"].default
    discover: bool = KEYS["discover"].default
    nvml_timeout: float = KEYS["nvml_timeout"].default
    flight_recorder_timeout: float = KEYS["flight_recorder_timeout"].default
    gpu_dump: str = KEYS["gpu_dump"].default
    gpu_dump_timeout: float = KEYS["gpu_dump_timeout"].default
    max_state_bytes: float = KEYS["max_state_bytes"].default
    dump_max_age_days: float = KEYS["dump_max_age_days"].default
    incident_max_age_days: float = KEYS["incident_max_age_days"].default
    store: str = KEYS["store"].default
    node_name: str = KEYS["node_name"].default
    store_poll_interval: float = KEYS["store_poll_interval"].default
    store_spool_max: int = KEYS["store_spool_max"].default
    job_incident_window: float = KEYS["job_incident_window"].default
    log_format: str = KEYS["log_format"].default
    log_level: str = KEYS["log_level"].default

    @property
    def dumps(self) -> Path:
        return Path(self.dump_dir) if self.dump_dir else Path(self.state_dir) / "dumps"

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


def _validate(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in KEYS:
            raise ConfigError(f"{where}: unknown key '{key}'; known keys: {', '.join(KEYS)}")
        allowed = KEYS[key].check(value)
        if allowed:
            raise ConfigError(f"{where}: key '{key}' = {value!r} is not allowed; expected {allowed}")
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def load(path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Defaults, then the file, then flags (``overrides``; None values are ignored)."""
    values: dict[str, Any] = {}
    if path is not None:
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
    return dataclasses.replace(Config(), **values)


def client_runtime_dir() -> Path:
    """Where a workload looks for the daemon."""
    return Path(os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)
