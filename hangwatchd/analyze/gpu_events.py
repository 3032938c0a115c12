"""GPU faults near a hang, each given to whoever caused it: the GPU, the process itself, or another process.

The daemon writes ``PID/gpu-events.json`` beside a captured process that ran
on a GPU with XID events, or that an event names (``host.gpu_events``): its
GPUs (index, UUID, serial, PCI address), when it last made progress
(``stopped``) and the events, each with the process the kernel log named. An
event within ``WINDOW`` seconds of the stop is read by NVIDIA's catalogue
(``host/xid.py``):

- a fault of the GPU or the node (79, 48, 95, GSP, a lost GPU, ...) may explain
  the hang of any process on that GPU: it leads the verdict ("GPU 3 reported XID
  79 (fell off the bus) 2 s before rank 3 stopped: a GPU fault, not the program,
  likely explains the hang") and blames the GPU;
- an application's fault (13, 31, 43, 45) is blamed on its own process only:
  the process's own leads its verdict ("pid 972 hit XID 31 ... on GPU 0: a fault
  of the program itself"), another process's is context, said after the
  verdict ("another process on GPU 0, pid 2149 (python3) of job eval, hit XID 31
  ... 4 s before pid 972 stopped: that process's own fault, not this hang's
  cause"), and one whose process nobody named (the kernel log not read) is said
  to be an application's, never taken for the cause.

Each fault the verdict rests on is a ``Blame`` with its GPU and node, for the
ledger of suspects. Works on a directory put together by hand too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..host import xid as xids
from .jsonfile import read_json_or_none
from .records import Blame, RankVerdict

WINDOW = 600.0  # seconds around the stop in which an XID counts as its cause (or its context)
MAX_SENTENCES = 3
MAX_CONTEXT = 2


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _kind(e: dict[str, Any]) -> str:
    if e.get("lost"):
        return xids.GPU
    number = _int(e.get("xid"))
    return xids.kind(number, _int(e.get("cause"))) if number is not None else xids.UNKNOWN


def _what(e: dict[str, Any]) -> str:
    number = _int(e.get("xid"))
    return _str(e.get("what")) or (xids.describe(number) if number is not None else "an XID error")


def _gpu_name(e: dict[str, Any]) -> str:
    if _int(e.get("gpu")) is not None:
        return f"GPU {e['gpu']}"
    return f"the GPU at PCI {e['pci']}" if _str(e.get("pci")) else "a GPU"


def _when(e: dict[str, Any], stopped: float) -> str:
    dt = float(e["time"]) - stopped
    return "as" if abs(dt) < 0.5 else (f"{-dt:.0f} s before" if dt < 0 else f"{dt:.0f} s after")


def _own(e: dict[str, Any], pid: int, start: int | None) -> bool | None:
    """Whether the event named this very process (its pid, and its start time where both say one)."""
    named = _int(e.get("pid"))
    if named is None:
        return None
    theirs = _int(e.get("start_time"))
    return named == pid and (start is None or theirs is None or theirs == start)


def _gpu_fault(e: dict[str, Any], who: str, stopped: float) -> str:
    what = "stopped answering NVML (GPU lost)" if e.get("lost") else f"reported XID {e.get('xid')} ({_what(e)})"
    return f"{_gpu_name(e)} {what} {_when(e, stopped)} {who} stopped"


def _own_fault(e: dict[str, Any], who: str, stopped: float) -> str:
    return f"{who} hit XID {e.get('xid')} ({_what(e)}) on {_gpu_name(e)} {_when(e, stopped)} it stopped"


def _others_fault(e: dict[str, Any], who: str, stopped: float) -> str:
    pid = _int(e.get("pid"))
    if pid is None:
        return (f"{_gpu_name(e)} reported XID {e.get('xid')} ({_what(e)}) {_when(e, stopped)} {who} stopped, an application's "
                "fault whose process the kernel log would name (not read here): not taken for this hang's cause")
    name = f" ({e['process']})" if _str(e.get("process")) else ""
    of = (f" of job {e['job']}" if _str(e.get("job")) else "") + (f" rank {e['rank']}" if _int(e.get("rank")) is not None else "")
    return (f"another process on {_gpu_name(e)}, pid {pid}{name}{of}, hit XID {e.get('xid')} ({_what(e)}) "
            f"{_when(e, stopped)} {who} stopped: that process's own fault, not this hang's cause")


def _gpu_table(pdir: Path, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The process's GPUs as the daemon described them, else as its nvml.json did."""
    rows = [g for g in data.get("gpu_info") or [] if isinstance(g, dict)]
    nvml = read_json_or_none(pdir / "nvml.json")
    if isinstance(nvml, dict):
        for d in nvml.get("devices") or []:
            if isinstance(d, dict) and _int(d.get("index")) is not None and not any(r.get("index") == d["index"] for r in rows):
                rows.append({"index": d["index"], "uuid": d.get("uuid"), "serial": d.get("serial"),
                             "pci": xids.pci_key(str(d.get("pci_bus_id") or ""))})
    return rows


def _blame(kind: str, why: str, e: dict[str, Any], v: RankVerdict, node: str | None,
           table: list[dict[str, Any]]) -> Blame:
    gpu = _int(e.get("gpu"))
    row = next((r for r in table if (gpu is not None and r.get("index") == gpu)
                or (_str(e.get("pci")) and r.get("pci") == e.get("pci"))), {})
    return Blame(kind, why, v.pid, v.rank, node, gpu if gpu is not None else _int(row.get("index")),
                 _str(e.get("uuid")) or _str(row.get("uuid")), _str(e.get("serial")) or _str(row.get("serial")),
                 _str(e.get("pci")) or _str(row.get("pci")), None if e.get("lost") else _int(e.get("xid")), _num(e.get("time")))


def read(pdir: Path, verdict: RankVerdict, since: float | None, node: str | None
         ) -> tuple[list[str], list[str], list[str], list[Blame]]:
    """For one process: the sentences of GPU faults, of its own faults, of others' (context), and the blames."""
    data = read_json_or_none(pdir / "gpu-events.json")
    if not isinstance(data, dict) or verdict.pid is None:
        return [], [], [], []
    stopped = _num(data.get("stopped")) or since
    events = [e for e in data.get("events") or [] if isinstance(e, dict) and _num(e.get("time")) is not None]
    if stopped is None or not events:
        return [], [], [], []
    proc = read_json_or_none(pdir / "proc.json")
    node = (_str(proc.get("node")) if isinstance(proc, dict) else None) or node
    near = sorted((e for e in events if abs(float(e["time"]) - stopped) <= WINDOW),
                  key=lambda e: (not e.get("needs_reset"), abs(float(e["time"]) - stopped)))
    who = f"rank {verdict.rank}" if verdict.rank is not None else f"pid {verdict.pid}"
    start = _int(data.get("start_time"))
    table = _gpu_table(pdir, data)
    gpu: list[str] = []
    own: list[str] = []
    others: list[str] = []
    blames: list[Blame] = []
    for e in near:
        if _kind(e) == xids.GPU:
            if not gpu:  # the one that explains it: a reset-worthy one first, then the nearest
                gpu.append(_gpu_fault(e, who, stopped))
                blames.append(_blame("gpu", gpu[-1], e, verdict, node, table))
        elif _own(e, verdict.pid, start):
            if not own:
                own.append(_own_fault(e, who, stopped))
                blames.append(_blame("application", own[-1], e, verdict, node, table))
        elif _kind(e) == xids.APPLICATION and len(others) < MAX_CONTEXT:
            s = _others_fault(e, who, stopped)
            if s not in others:
                others.append(s)
    return gpu, own, others, blames


def judge(processes: list[tuple[Path, RankVerdict]], summary: str, meta: dict[str, Any]) -> tuple[str, tuple[Blame, ...]]:
    """``summary`` led by the GPU faults that explain the hang, and followed by other processes' faults
    on the same GPUs; with the faults the verdict rests on, each against its GPU and node.
    ``processes``: each captured process's directory and verdict."""
    since = _num(meta.get("since"))
    node = _str(meta.get("node")) or _str(meta.get("host"))
    gpu: list[str] = []
    own: list[str] = []
    others: list[str] = []
    blames: list[Blame] = []
    for pdir, v in processes:
        if v.pid is None:
            continue
        g, o, c, b = read(pdir, v, since, node)
        gpu += [s for s in g if s not in gpu]
        own += [s for s in o if s not in own]
        others += [s for s in c if s not in others]
        blames += b
    text = summary
    if own:
        lead = "; ".join(own[:MAX_SENTENCES])
        text = f"{lead[0].upper()}{lead[1:]}: a fault of the program itself (NVIDIA's catalogue: restart the application). {text}"
    if gpu:
        lead = "; ".join(gpu[:MAX_SENTENCES])
        text = f"{lead[0].upper()}{lead[1:]}: a GPU fault, not the program, likely explains the hang. {text}"
    if others:
        context = "; ".join(others[:MAX_CONTEXT])
        text = f"{text.rstrip()} {context[0].upper()}{context[1:]}."
    return text.strip(), tuple(blames)
