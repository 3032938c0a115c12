"""PyTorch's flight recorder dump (flight-recorder.pkl), read safely.

The file comes from the watched workload, and unpickling can run code: the
loader accepts plain data only (dicts, lists, tuples, strings, numbers), never
a class, so a hostile file is refused, not executed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_BYTES = 256 << 20


def _plain_data(raw: bytes) -> Any:
    """Unpickle plain data only. pickle is imported here, when a trace is read: `hangwatchd show`
    of an incident without one (most) does not pay for it."""
    import io
    import pickle

    class PlainData(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: the trace must be plain data")

    return PlainData(io.BytesIO(raw)).load()


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
    """``read`` of bytes already read (never raises, never runs code)."""
    try:
        data = _plain_data(raw)
    except Exception as exc:  # a hostile or torn pickle can raise nearly anything; it is only data we could not read
        return None, f"not a flight-recorder trace ({type(exc).__name__}: {str(exc)[:100]})"
    if not isinstance(data, dict):
        return None, "not a flight-recorder trace (not a dict)"
    status: dict[str, tuple[int, int, int]] = {}
    pg_status = data.get("pg_status")
    for pg, st in (pg_status.items() if isinstance(pg_status, dict) else ()):
        if isinstance(st, dict):
            status[str(pg)[:64]] = (_int(st.get("last_enqueued_collective")), _int(st.get("last_started_collective")),
                                    _int(st.get("last_completed_collective")))
    entries = []
    raw_entries = data.get("entries")
    for e in raw_entries if isinstance(raw_entries, (list, tuple)) else ():
        if not isinstance(e, dict):
            continue
        pg = e.get("process_group")
        pg_id = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", "0"))
        name = str(e.get("profiling_name") or "?").split(":", 1)[-1][:200]
        frames = tuple((str(f.get("name"))[:500], str(f.get("filename"))[:1000], _int(f.get("line"), 0))
                       for f in (e.get("frames") if isinstance(e.get("frames"), (list, tuple)) else ())
                       if isinstance(f, dict))
        seq = e.get("collective_seq_id")
        entries.append(Entry(pg_id[:64], _int(seq, None) if not e.get("is_p2p") else None, name,
                             str(e.get("state") or "?")[:32], e.get("input_sizes"), e.get("input_dtypes"),
                             e.get("output_sizes"), frames))
    return FlightRecord(status, tuple(entries)), None


def _int(value: Any, default: Any = -1) -> Any:
    """An int field, or ``default`` where the trace has anything else there (a string, a float, a bool)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default
