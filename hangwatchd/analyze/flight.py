"""PyTorch's flight recorder dump (flight-recorder.pkl), read safely.

The file comes from the watched workload, and its bytes are the user's
choice. It is decoded by ``host.plain_pickle`` (plain data only, linear time,
never a class), then read field by field: only strings are taken as names
(never ``str()`` of whatever a field holds), lists are cut at a count, the
sizes and types kept are bounded copies, so a trace that shares itself or
nests a million deep costs its bytes and no more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..host import plain_pickle

MAX_BYTES = 16 << 20  # a trace of PyTorch's default 2,000 entries with their frames is a few MB
MAX_ENTRIES = 20_000
MAX_FRAMES = 64  # per entry, innermost first as PyTorch records them
MAX_GROUPS = 4096


@dataclass(frozen=True)
class Entry:
    pg: str
    seq: int | None  # collective_seq_id (None for point-to-point)
    name: str  # "all_gather", from "nccl:all_gather"
    state: str  # scheduled, started, completed
    input_sizes: Any  # a bounded copy: lists of ints, a few levels deep
    input_dtypes: Any
    output_sizes: Any
    frames: tuple[tuple[str, str, int], ...]


@dataclass(frozen=True)
class FlightRecord:
    pg_status: dict[str, tuple[int, int, int]]  # pg -> (last enqueued, started, completed)
    entries: tuple[Entry, ...]

    def entry(self, pg: str, seq: int) -> Entry | None:
        for e in self.entries:
            if e.pg == pg and e.seq == seq:
                return e
        return None


def load(path: Path) -> FlightRecord | None:
    """The record, or None when there is none or it is not one (never raises, never runs code)."""
    return read(path)[0]


def read(path: Path) -> tuple[FlightRecord | None, str | None]:
    """The record and, where there is a file but no record, why (never raises, never runs code)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    if len(raw) > MAX_BYTES:
        return None, f"larger than {MAX_BYTES >> 20} MB, not read"
    return parse(raw)


def parse(raw: bytes) -> tuple[FlightRecord | None, str | None]:
    """``read`` of bytes already read (never raises, never runs code; linear in ``raw``)."""
    try:
        data = plain_pickle.loads(raw, MAX_BYTES)
    except plain_pickle.NotPlainData as exc:
        return None, f"not a flight-recorder trace ({exc})"
    if not isinstance(data, dict):
        return None, "not a flight-recorder trace (not a dict)"
    status: dict[str, tuple[int, int, int]] = {}
    pg_status = data.get("pg_status")
    for pg, st in list(pg_status.items())[:MAX_GROUPS] if isinstance(pg_status, dict) else ():
        if isinstance(st, dict):
            status[_text(pg, 64)] = (_int(st.get("last_enqueued_collective")), _int(st.get("last_started_collective")),
                                     _int(st.get("last_completed_collective")))
    entries = [_entry(e) for e in plain_pickle.iter_list(data.get("entries"), MAX_ENTRIES) if isinstance(e, dict)]
    return FlightRecord(status, tuple(entries)), None


def _entry(e: dict[Any, Any]) -> Entry:
    pg = e.get("process_group")
    pg_id = _text(pg[0], 64) if isinstance(pg, (list, tuple)) and pg else _text(e.get("pg_id", "0"), 64)
    name = _text(e.get("profiling_name"), 200, "?").split(":", 1)[-1]
    frames = tuple((_text(f.get("name"), 500), _text(f.get("filename"), 1000), _int(f.get("line"), 0))
                   for f in plain_pickle.iter_list(e.get("frames"), MAX_FRAMES) if isinstance(f, dict))
    seq = None if e.get("is_p2p") is True else _int(e.get("collective_seq_id"), None)
    return Entry(pg_id, seq, name, _text(e.get("state"), 32, "?"), _sizes(e.get("input_sizes")),
                 _sizes(e.get("input_dtypes")), _sizes(e.get("output_sizes")), frames)


def _sizes(value: Any) -> Any:
    return plain_pickle.bounded(value, max_nodes=256, max_depth=4, max_str=32)


def _text(value: Any, limit: int, default: str = "None") -> str:
    """A string field cut at ``limit``; ints as their digits; ``default`` for anything else (never str() of user data)."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)[:limit]
    return default


def _int(value: Any, default: Any = -1) -> Any:
    """An int field, or ``default`` where the trace has anything else there (a string, a float, a bool)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default
