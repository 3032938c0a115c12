"""A GPU fault that explains a hang: an XID on a rank's GPU shortly before (or while) it stopped.

The daemon writes ``PID/gpu-events.json`` beside a captured process that ran
on a GPU with XID events (``host.gpu_events``): the GPUs, the time the process
last made progress (``stopped``) and the events. When one of them came within
``WINDOW`` seconds of the stop, the GPU, not the program, is the likely cause,
and the verdict says so first: "GPU 3 reported XID 79 (fell off the bus) 2 s
before rank 3 stopped". Works on a directory put together by hand too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .jsonfile import read_json_or_none
from .records import RankVerdict

WINDOW = 600.0  # seconds around the stop in which an XID counts as its cause
MAX_SENTENCES = 3


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _phrase(event: dict[str, Any], who: str, stopped: float) -> str:
    gpu = event.get("gpu")
    what = "stopped answering NVML (GPU lost)" if event.get("lost") else f"reported XID {event.get('xid')} ({event.get('what')})"
    dt = _num(event.get("time"))
    if dt is None:
        return f"GPU {gpu} {what} around the time {who} stopped"
    dt -= stopped
    when = "as" if abs(dt) < 0.5 else (f"{-dt:.0f} s before" if dt < 0 else f"{dt:.0f} s after")
    return f"GPU {gpu} {what} {when} {who} stopped"


def cause(pdir: Path, verdict: RankVerdict, since: float | None) -> str | None:
    """The sentence for one process, or None when no GPU event of its own came near its stop."""
    data = read_json_or_none(pdir / "gpu-events.json")
    if not isinstance(data, dict):
        return None
    stopped = _num(data.get("stopped")) or since
    events = [e for e in data.get("events") or [] if isinstance(e, dict)]
    if stopped is None or not events:
        return None
    near = [e for e in events if _num(e.get("time")) is not None and abs(float(e["time"]) - stopped) <= WINDOW]
    if not near:
        return None
    # A fault that needs a reset first, then the one nearest the stop.
    near.sort(key=lambda e: (not e.get("needs_reset"), abs(float(e["time"]) - stopped)))
    who = f"rank {verdict.rank}" if verdict.rank is not None else f"pid {verdict.pid}"
    return _phrase(near[0], who, stopped)


def explain(incident: Path, ranks: list[RankVerdict], summary: str, meta: dict[str, Any]) -> str:
    """``summary`` led by the GPU faults that explain the hang, if any."""
    since = _num(meta.get("since"))
    sentences = []
    for v in ranks:
        if v.pid is None:
            continue
        s = cause(incident / str(v.pid), v, since)
        if s and s not in sentences:
            sentences.append(s)
    if not sentences:
        return summary
    lead = "; ".join(sentences[:MAX_SENTENCES])
    return f"{lead[0].upper()}{lead[1:]}: a GPU fault, not the program, likely explains the hang. {summary}".strip()
