"""What every bench prints and writes: each figure with its same-run baseline, its target and ok/MISSED.

``report`` prints the lines and writes ``bench/results/NAME.md``, the table the
README shows between ``<!-- bench:NAME -->`` markers (``bench/_readme.py``
copies it there), so the README and the bench cannot disagree.
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Figure:
    what: str
    figure: str
    baseline: str  # measured in the same run, or what the figure is held against
    target: str  # "" where there is none
    ok: bool | None  # None where there is no target

    @property
    def verdict(self) -> str:
        return "" if self.ok is None else "ok" if self.ok else "MISSED"


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "-"


def report(name: str, figures: list[Figure], note: str = "") -> bool:
    """Print and write the figures; True when every target was met."""
    for f in figures:
        target = f"; target {f.target}" if f.target else ""
        verdict = f"  {f.verdict}" if f.verdict else ""
        print(f"{name}: {f.what}: {f.figure} (baseline: {f.baseline}{target}){verdict}", flush=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["| what | figure | baseline in the same run | target | result |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {_cell(f.what)} | {_cell(f.figure)} | {_cell(f.baseline)} | {_cell(f.target)} | {_cell(f.verdict)} |"
              for f in figures]
    lines += ["", f"`python bench/{name}.py`, {when}, {os.cpu_count()} cores ({platform.machine()})"
              + (f"; {note}" if note else "") + "."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    return all(f.ok is not False for f in figures)
