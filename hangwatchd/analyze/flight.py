"""PyTorch's flight recorder dump (flight-recorder.pkl), read safely.

The file comes from the watched workload, and unpickling can run code: the
loader accepts plain data only (dicts, lists, tuples, strings, numbers), never
a class, so a hostile file is refused, not executed.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_BYTES = 256 << 20


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: the trace must be plain data")


@dataclass(frozen=True)
class Entry:
    pg: str
    seq: int | None  # collective_seq_id (None for point-to-point)
    name: str  # "all_gather", from "nccl:all_gather"
    state: str  # scheduled, started, completed
    input_sizes: Any
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
    try:
        raw = path.read_bytes()[:MAX_BYTES]
        data = _PlainData(io.BytesIO(raw)).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError):
        return None
    if not isinstance(data, dict):
        return None
    status: dict[str, tuple[int, int, int]] = {}
    for pg, st in (data.get("pg_status") or {}).items():
        if isinstance(st, dict):
            status[str(pg)] = tuple(int(st.get(k, -1) if isinstance(st.get(k, -1), int) else -1) for k in (  # type: ignore[assignment]
                "last_enqueued_collective", "last_started_collective", "last_completed_collective"))
    entries = []
    for e in data.get("entries") or []:
        if not isinstance(e, dict):
            continue
        pg = e.get("process_group")
        pg_id = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", "0"))
        name = str(e.get("profiling_name") or "?").split(":", 1)[-1]
        frames = tuple((str(f.get("name")), str(f.get("filename")), int(f.get("line") or 0))
                       for f in e.get("frames") or [] if isinstance(f, dict))
        seq = e.get("collective_seq_id")
        entries.append(Entry(pg_id, seq if isinstance(seq, int) and not e.get("is_p2p") else None, name,
                             str(e.get("state") or "?"), e.get("input_sizes"), e.get("input_dtypes"),
                             e.get("output_sizes"), frames))
    return FlightRecord(status, tuple(entries))
