"""An incident as one self-contained HTML page (no network, no scripts), for pasting into a ticket.

It renders what ``report.incident.load`` read and the analysis it was given; it computes nothing.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

from ..analyze.jsonfile import read_json_or_none
from ..detect.patterns import is_user_frame

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:72em;color:#1b1b1b;padding:0 1em}
h1{font-size:1.35em;margin:.2em 0 .6em} h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
.summary{background:#fff4e5;border-left:4px solid #e8890c;padding:.7em 1em;font-size:1.1em}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3} .ok{color:#146c2e} .bad{color:#b3261e} .skip{color:#777}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font:12.5px/1.4 ui-monospace,monospace}
.user{background:#fff1a8;font-weight:600} .meta{color:#555} details{margin:.6em 0} details>summary{cursor:pointer;color:#555}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _frames_pre(frames: list[dict[str, Any]]) -> str:
    lines = []
    for f in frames:
        where = f"{f.get('filename')}:{f.get('line')}" if f.get("line") else (f.get("short_filename") or f.get("filename") or "?")
        text = _e(f"{f.get('name')} ({where})")
        lines.append(f'<span class="user">&gt; {text}</span>' if is_user_frame(f) else f"  {text}")
    return "<pre>" + "\n".join(lines) + "</pre>"


def _thread(thread: dict[str, Any]) -> str:
    return (f"<p class=meta>Thread {_e(thread.get('os_thread_id') or thread.get('thread_id'))} "
            f"{_e(thread.get('thread_name') or '')}</p>" + _frames_pre(thread.get("frames") or []))


def _gpu(sym: dict[str, Any]) -> str:
    out = []
    for e in sym.get("exceptions", []):
        chain = "\n".join(f"{f['function']} ({f['file']}:{f['line']})" if f.get("file") else f"{f['function']} (no line information)"
                          for f in e.get("frames", []))
        out.append(f"<p><b>{_e(e['type'])}</b> on device {_e(e['device'])}, SM {_e(e['sm'])}, warp {_e(e['warp'])} "
                   f"at {_e(e['pc'])} in {_e(e.get('kernel'))}</p><pre>{_e(chain)}</pre>")
    for k in sym.get("kernels", []):
        out.append(f"<p>Kernel <b>{_e(k['name'])}</b>: grid {_e(k['grid_dim'])}, block {_e(k['block_dim'])}, "
                   f"{_e(k['status'])}, SMs {_e(k['sms'])}</p>")
        for p in [p for p in sym.get("pcs", []) if p.get("kernel") == k["name"]]:
            chain = "\n".join(f"{f['function']} ({f['file']}:{f['line']})" if f.get("file") else f"{f['function']}"
                              for f in p.get("frames", []))
            out.append(f"<p class=meta>{_e(p['warps'])} warps, {_e(p['lanes'])} lanes at {_e(p['pc'])}</p><pre>{_e(chain)}</pre>")
    return "".join(out)


def render(data: dict[str, Any], incident_dir: Path) -> str:
    a = data.get("analysis") or {}
    when = data.get("time")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when)) if isinstance(when, (int, float)) else "?"
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>hangwatchd incident {_e(data.get('id'))}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>Incident {_e(data.get('id'))}</h1>",
             f"<p class=summary id=summary>{_e(a.get('summary'))}</p>",
             f"<p class=meta>{_e(stamp)} on {_e(data.get('host'))} &middot; reason {_e(data.get('reason'))}: "
             f"{_e(data.get('detail') or data.get('note'))}"
             + (f" &middot; job {_e(data['job'])}" if data.get("job") else "")
             + (f" &middot; signals {_e(', '.join(data['signals']))}" if data.get("signals") else "") + "</p>"]
    if a.get("culprits"):
        parts.append("<h2>Culprit</h2>" + _table(["rank", "pid", "node, GPU", "why", "where"], [
            [_e(c["rank"]) if c.get("rank") is not None else "-", _e(c["pid"]),
             _e(", ".join(x for x in (c.get("node"), f"GPU {c['gpu']}" if c.get("gpu") is not None else None) if x)),
             _e(c["reason"]), _e(c.get("location"))]
            for c in a["culprits"]]))
    if a.get("blame"):
        parts.append("<h2>GPU faults it rests on</h2>" + _table(["blames", "node", "GPU", "UUID", "serial", "XID", "why"], [
            [_e("the GPU" if b.get("kind") == "gpu" else "the program, on its GPU"), _e(b.get("node")), _e(b.get("gpu")),
             _e(b.get("uuid")), _e(b.get("serial")), _e(b.get("xid") if b.get("xid") is not None else "GPU lost"), _e(b.get("why"))]
            for b in a["blame"]]))
    if a.get("ranks"):
        parts.append("<h2>Ranks</h2>" + _table(["rank", "pid", "verdict", "detail", "where", "last collective"], [
            [_e(r["rank"]) if r.get("rank") is not None else "-", _e(r["pid"]), f"<b>{_e(r['verdict'])}</b>", _e(r["detail"]), _e(r.get("location")),
             _e(f"{r['last_collective'][0]}#{r['last_collective'][1]}" if r.get("last_collective") else "")]
            for r in a["ranks"]]))
    if a.get("collectives"):
        parts.append("<h2>Collectives (flight recorder)</h2>" + _table(["pg", "#", "collective", "entered by", "never by", "mismatch"], [
            [_e(c["pg"]), _e(c["seq"]), _e(c["name"]), _e(c["ranks_entered"]), _e(c["ranks_missing"]), _e(c.get("mismatch"))]
            for c in a["collectives"]]))
    children = data.get("children") or []
    if children:
        parts.append("<h2>Children of the hung processes</h2>" + _table(["child", "pid", "parent", "verdict", "detail", "where"], [
            [_e(c.get("role") or "child"), _e(c["pid"]), _e(c.get("parent")), f"<b>{_e(c.get('verdict'))}</b>",
             _e(c.get("detail")), _e(c.get("location"))] for c in children]))
    for proc in data.get("processes", []):
        rank = f" (rank {proc['rank']})" if proc.get("rank") is not None else ""
        parts.append(f"<h2>Process {_e(proc.get('pid'))}{_e(rank)}</h2><p class=meta>{_e(' '.join(proc.get('cmdline') or []))}</p>")
        steps = proc.get("steps") or []
        if steps:
            parts.append(_table(["step", "outcome", "seconds", "note"], [
                [_e(s["step"]), '<span class="skip">n/a</span>' if s.get("not_applicable") else
                 '<span class="skip">skipped</span>' if s.get("skipped") else
                 '<span class="bad">damaged</span>' if s.get("damaged") else
                 ('<span class="ok">ok</span>' if s["ok"] else '<span class="bad">failed</span>'),
                 f"{s['seconds']:.2f}", _e(f"ok when captured, but {s['damaged']}" if s.get("damaged") else s.get("error"))]
                for s in steps]))
        for thread in proc.get("stacks") or []:
            parts.append(_thread(thread))
        sym_path = incident_dir / str(proc.get("dir") or proc.get("pid")) / "symbolized.json"
        sym = read_json_or_none(sym_path)
        if sym:
            parts.append("<h3>GPU</h3>" + _gpu(sym))
    for child in children:
        # The stuck child is the story: its stack open; children that only wait, folded.
        stuck = child.get("verdict") == "child-stuck"
        title = (f"{_e(child.get('role') or 'child')} {_e(child['pid'])} (child of {_e(child.get('parent'))}): "
                 f"{_e(child.get('verdict'))}")
        stacks = "".join(_thread(t) for t in child.get("stacks") or []) or "<p class=meta>(no stacks were captured)</p>"
        if stuck:
            parts.append(f"<h2>Child process {title}</h2><p class=meta>{_e(child.get('detail'))}</p>{stacks}")
        else:
            parts.append(f"<details><summary>Child process {title}</summary><p class=meta>{_e(child.get('detail'))}</p>"
                         f"{stacks}</details>")
    parts.append("<p class=meta>Frames run innermost first; highlighted lines are your code. Made by hangwatchd.</p></body></html>")
    return "".join(parts)


def pages(incident_dir: Path, analysis: dict[str, Any], record: dict[str, Any] | None = None) -> dict[str, str]:
    """The page stored beside each incident.json, rendering ``analysis`` of it (``record``: the
    incident.json a draft will hold, where it is not written yet)."""
    from . import incident

    return {"report.html": render(incident.load(incident_dir, analysis, record), incident_dir)}
