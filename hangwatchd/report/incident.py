"""An incident directory read back for people (text) and scripts (JSON).

The reading is here once; the text renderer only formats what it returns. The
analysis is handed in by whoever asks (the CLI, the store's page writer): a
report renders a verdict, it never computes one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..analyze.jsonfile import Unreadable, read_json, read_json_or_none
from ..analyze.stacks import load_threads
from ..detect.patterns import is_user_frame
from .names import fold
from .terminal import clean


def load(incident_dir: Path, analysis: dict[str, Any], record: dict[str, Any] | None = None) -> dict[str, Any]:
    """incident.json (or ``record``, what it will hold, for a draft not yet committed) with each
    process's captured files attached (stacks, proc facts) and ``analysis``."""
    data = dict(record) if record is not None else read_json_or_none(incident_dir / "incident.json")
    if not isinstance(data, dict):
        data = {"id": incident_dir.name, "complete": False, "note": "incident.json is missing or damaged"}
    processes = data.get("processes") or []
    if not processes:  # a directory put together by hand: every pid directory but the children's
        kids = {c.get("pid") for c in (analysis or {}).get("children") or [] if isinstance(c, dict)}
        processes = [{"pid": int(p.name), "dir": p.name} for p in sorted(incident_dir.iterdir())
                     if p.is_dir() and p.name.isdigit() and int(p.name) not in kids]
    for proc in processes:
        pdir = incident_dir / str(proc.get("dir") or proc.get("pid"))
        facts = read_json_or_none(pdir / "proc.json")
        proc["proc"] = facts if isinstance(facts, dict) else None
        proc["stacks"] = load_threads(pdir)
        proc["stacks_native"] = (pdir / "pyspy-native.json").exists()
        proc["steps"] = [_checked(s, pdir) for s in proc.get("steps") or [] if isinstance(s, dict)]
    data["processes"] = processes
    data["analysis"] = analysis
    data["children"] = _children(incident_dir, analysis)
    return data


def _checked(step: dict[str, Any], pdir: Path) -> dict[str, Any]:
    """A step as recorded, with ``damaged`` saying which of the JSON files it kept cannot be read now
    (truncated, emptied, removed): "ok" was true when it ran, and is no longer the whole story."""
    if not step.get("ok"):
        return step
    problems = []
    for name in step.get("files") or []:
        if not isinstance(name, str) or not name.endswith(".json") or "/" in name:
            continue
        try:
            read_json(pdir / name)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
        except Unreadable as exc:
            problems.append(f"{name} is {exc}" if exc.kind != "not_json" else f"{name} is damaged: {exc}")
    return {**step, "damaged": "; ".join(problems)} if problems else step


def _children(incident_dir: Path, analysis: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The hung processes' children the analysis judged, each with its captured stacks; the stuck
    ones (the story) first, then those that only wait."""
    rows = [c for c in ((analysis or {}).get("children") or []) if isinstance(c, dict) and isinstance(c.get("pid"), int)]
    rows.sort(key=lambda c: c.get("verdict") != "child-stuck")
    return [{**c, "stacks": load_threads(incident_dir / str(c["pid"]))} for c in rows]


def _frame_line(frame: dict[str, Any]) -> str:
    name = frame.get("name") or "??"
    if frame.get("module") or not frame.get("line"):
        where = frame.get("short_filename") or frame.get("filename") or "?"
        return f"{name} ({where})"
    return f"{name} ({frame.get('filename')}:{frame.get('line')})"


def _folded(lines: list[str]) -> str:
    """Lines joined, long C++ names folded; say where the whole names are when any was."""
    out = [fold(ln) for ln in lines]
    if out != lines:
        out += ["", "(long C++ names are shortened to <…> and (…); --json has them whole)"]
    return "\n".join(out) + "\n"


def render_analysis(a: dict[str, Any]) -> str:
    a = clean(a)  # rank names, RAS replies, symbol names: other people's text, for a terminal
    out = [a["summary"], ""]
    for c in a.get("culprits", []):
        where = f"pid {c['pid']}" + (f" on node {c['node']}" if c.get("node") else "") + (f", GPU {c['gpu']}" if c.get("gpu") is not None else "")
        who = f"rank {c['rank']} ({where})" if c.get("rank") is not None else where
        out.append(f"Culprit: {who}: {c['reason']}" + (f", at {c['location']}" if c.get("location") else ""))
    for b in a.get("blame") or []:
        ids = ", ".join(x for x in (b.get("uuid"), f"serial {b['serial']}" if b.get("serial") else None) if x)
        gpu = f"GPU {b['gpu']}" if b.get("gpu") is not None else "a GPU"
        out.append(f"Blames {'the GPU' if b.get('kind') == 'gpu' else 'the program, on its GPU'}: {gpu}"
                   + (f" ({ids})" if ids else "") + (f" on node {b['node']}" if b.get("node") else "") + f": {b.get('why')}")
    if a.get("ranks"):
        out += ["", "Ranks:"]
        for r in a["ranks"]:
            last = f"; last collective {r['last_collective'][0]}#{r['last_collective'][1]}" if r.get("last_collective") else ""
            who = f"rank {r['rank']} pid {r['pid']}" if r.get("rank") is not None else f"pid {r['pid']}"
            who += f" on node {r['node']}" if r.get("node") else ""
            out.append(f"  {who}: {r['verdict']} - {r['detail']}"
                       + (f" at {r['location']}" if r.get("location") else "") + last)
    if a.get("children"):
        out += ["", "Children of the hung processes:"]
        for r in a["children"]:
            out.append(f"  {r.get('role') or 'child'} pid {r['pid']} (of pid {r.get('parent')}): {r['verdict']} - {r['detail']}"
                       + (f" at {r['location']}" if r.get("location") else ""))
    if a.get("collectives"):
        out += ["", "Collectives (flight recorder):"]
        for c in a["collectives"]:
            out.append(f"  pg {c['pg']} #{c['seq']} {c['name']}: entered by {list(c['ranks_entered'])}"
                       + (f", never by {list(c['ranks_missing'])}" if c["ranks_missing"] else "")
                       + (f"; {c['mismatch']}" if c.get("mismatch") else ""))
    if a.get("rests_on"):
        out += ["", "The verdict rests on:"] + [f"  {line}" for line in a["rests_on"]]
    if a.get("unreadable"):
        out += ["", "Could not be read:"] + [f"  {line}" for line in a["unreadable"]]
    return _folded(out)


def render_text(data: dict[str, Any]) -> str:
    data = clean(data)  # STATUS=, job names, cmdlines, frames: other people's text, for a terminal
    when = data.get("time")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when)) if isinstance(when, (int, float)) else "?"
    state = "complete" if data.get("complete", True) else "INCOMPLETE"
    pending = [p for p in data.get("pending") or [] if isinstance(p, dict)]
    if pending:
        state += ", evidence still coming"
    analysis = data.get("analysis")
    out = [analysis["summary"]] if analysis else []
    if pending:  # the verdict may change once the flight recorders and GPU dumps are in
        until = max((p.get("until") or 0 for p in pending), default=0)
        out.append("(still coming: " + ", ".join(f"{p.get('step')} of pid {p.get('pid')}" for p in pending)
                   + (f", by {time.strftime('%H:%M:%S UTC', time.gmtime(until))}" if until else "")
                   + "; this verdict is on what has come)")
    out += [""] if analysis else []
    out += [f"Incident {data.get('id')} ({state})",
           f"  {stamp} on {data.get('host', '?')}: {data.get('reason', '?')} - {data.get('detail') or data.get('note') or ''}"]
    if data.get("job"):
        out.append(f"  job {data['job']}" + (f", job incident {data['job_incident']} (node {data.get('node')})"
                                              if data.get("job_incident") else ""))
    if data.get("signals"):
        out.append(f"  signals that agreed: {', '.join(data['signals'])}")
    if data.get("notify_status"):
        out.append(f"  the workload's last STATUS=: {data['notify_status']}")
    for proc in data["processes"]:
        rank = f" rank {proc['rank']}" if proc.get("rank") is not None else ""
        cmd = " ".join(proc.get("cmdline") or (proc.get("proc") or {}).get("cmdline") or [])
        out += ["", f"Process {proc.get('pid')}{rank}: {cmd}"]
        steps = proc.get("steps") or []
        coming = [p.get("step") for p in pending if p.get("pid") == proc.get("pid")]
        if steps or coming:
            out.append("  capture:")
            for s in steps:
                outcome = ("n/a" if s.get("not_applicable") else "skipped" if s.get("skipped") else
                           "DAMAGED" if s.get("damaged") else "ok" if s["ok"] else "FAILED")
                why = (f" - ok when captured, but {s['damaged']}" if s.get("damaged") else
                       f" - {s['error']}" if s.get("error") else "")
                out.append(f"    {s['step']:<16} {outcome:<8} {s['seconds']:6.2f} s{why}")
            out += [f"    {step!s:<16} coming" for step in coming]
        stacks = proc.get("stacks")
        if not stacks:
            out.append("  (no stacks were captured)")
            continue
        for thread in stacks:
            flags = ", ".join(f for f, on in (("active", thread.get("active")), ("holds the GIL", thread.get("owns_gil"))) if on)
            out.append(f"  Thread {thread.get('os_thread_id') or thread.get('thread_id')} "
                       f"\"{thread.get('thread_name') or ''}\"" + (f" ({flags})" if flags else " (idle)"))
            for frame in thread.get("frames") or []:
                mark = ">" if is_user_frame(frame) else " "
                out.append(f"  {mark} {_frame_line(frame)}")
    if analysis:
        out += ["", "Analysis:"] + ["  " + ln for ln in render_analysis(analysis).splitlines()[2:] if ln and not ln.startswith("(long C++")]
    out += ["", "Frames run innermost first; '>' marks your code."]
    return _folded(out)
