"""One captured process's evidence, read from its directory without ever raising.

Every file in an incident came from a capture of someone's process, or was put
there by hand: any of them may be missing, truncated, huge or not what its
name says. Each reader keeps what it can; what it cannot read becomes one
line saying which file and why, and the verdict says what it rested on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cudacore import sandbox
from . import flight, ras, raw_dump
from .jsonfile import Unreadable, read_json
from .stacks import read_threads


@dataclass(frozen=True)
class Evidence:
    proc: dict[str, Any]
    symbolized: dict[str, Any]
    nvml: dict[str, Any]
    threads: tuple[dict[str, Any], ...]
    native: bool  # the stacks include native frames
    record: flight.FlightRecord | None
    ras: ras.RasView | None
    used: tuple[str, ...]  # what there was to go on: stacks, GPU dump, NVML, ...
    problems: tuple[str, ...]  # what could not be read, and why
    exits: tuple[dict[str, Any], ...] = ()  # its descendants that exited before the capture (exits.json)
    report: dict[str, Any] | None = None  # the process's own answer to the daemon's introspection (introspect.json)


def read_json_object(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """A JSON object from ``path``; None (and a line in ``problems`` unless it is absent) otherwise."""
    label = f"{path.parent.name}/{path.name}"
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    except Unreadable as exc:
        problems.append(f"{label}: {exc}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{label}: not a JSON object")
        return None
    return data


def read(pdir: Path, known: dict[str, Any] | None = None, raw_dumps: sandbox.Limits | None = None) -> Evidence:
    """``raw_dumps``: symbolise a raw dump found without symbolized.json (``raw_dump``), in the
    sandbox under these limits (``hangwatchd analyze``); the daemon's own analyses never do."""
    problems: list[str] = []
    used: list[str] = []
    proc = read_json_object(pdir / "proc.json", problems)
    if proc is None:
        proc = known if isinstance(known, dict) else {}
    sym = read_json_object(pdir / "symbolized.json", problems) or {}
    if not sym and raw_dumps is not None and not (pdir / "symbolized.json").exists():
        from_raw, why_raw = raw_dump.symbolized(pdir, raw_dumps)
        sym = from_raw or {}
        problems += [why_raw] if why_raw else []
    nvml = read_json_object(pdir / "nvml.json", problems) or {}
    threads, why = read_threads(pdir)
    problems += why
    report = read_json_object(pdir / "introspect.json", problems)
    if threads:
        _quote_code(pdir, threads, report, problems)
    record, why_fr = flight.read(pdir / "flight-recorder.pkl")
    if why_fr:
        problems.append(f"{pdir.name}/flight-recorder.pkl: {why_fr}")
    view, why_ras = ras.read(pdir)
    problems += why_ras
    native = (pdir / "pyspy-native.json").exists() and threads is not None and not any(
        "pyspy-native.json" in p for p in why)
    if threads is not None:
        used.append("native stacks" if native else "Python stacks")
    if sym:
        used.append("GPU dump")
    if nvml:
        used.append("NVML")
    if record is not None:
        used.append("flight recorder")
    if view is not None:
        used.append(f"NCCL RAS ({view.source})")
    exits = _exits(pdir, problems)
    if exits:
        used.append("recorded exits")
    if report is not None:
        used.append("introspection")
    return Evidence(proc, sym, nvml, tuple(threads or ()), native, record, view, tuple(used), tuple(problems),
                    tuple(exits), report)


MAX_EXITS = 1024
CODE_FILE = "code.json"  # lines of the program's frames, read at the capture as the process's user


def _quote_code(pdir: Path, threads: list[dict[str, Any]], report: dict[str, Any] | None, problems: list[str]) -> None:
    """code.json's lines put on the frames they belong to (``code``), where the capture read them:
    the stacks' frames, and each thread's last CUDA graph replay in the process's own report."""
    data = read_json_object(pdir / CODE_FILE, problems)
    if data is None:
        return
    code = {(x["file"], x["line"]): x["code"] for x in dicts(data.get("lines"))
            if isinstance(x.get("code"), str) and isinstance(x.get("line"), int) and isinstance(x.get("file"), str)}
    for t in threads:
        for f in t.get("frames") or []:
            if isinstance(f, dict) and (f.get("filename"), f.get("line")) in code:
                f["code"] = code[(f.get("filename"), f.get("line"))][:200]
    for t in dicts((report or {}).get("threads")):
        r = t.get("graph_replay")
        if isinstance(r, dict) and isinstance(r.get("file"), str) and (r.get("file"), r.get("line")) in code:
            r["code"] = code[(r.get("file"), r.get("line"))][:200]


def _exits(pdir: Path, problems: list[str]) -> list[dict[str, Any]]:
    """exits.json: the process's descendants that exited before the capture (a list of objects)."""
    try:
        data = read_json(pdir / "exits.json")
    except FileNotFoundError:
        return []
    except Unreadable as exc:
        problems.append(f"{pdir.name}/exits.json: {exc}")
        return []
    if isinstance(data, dict):
        data = data.get("exits")
    if not isinstance(data, list):
        problems.append(f"{pdir.name}/exits.json: not a list of exits")
        return []
    return [x for x in data[:MAX_EXITS] if isinstance(x, dict)]


def dicts(value: Any) -> list[dict[str, Any]]:
    """The objects in a JSON list (anything else in it, or a non-list, is dropped)."""
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
