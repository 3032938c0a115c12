"""What every bench prints and writes: each figure with its same-run baseline, its target and ok/MISSED.

``report`` prints the lines and writes ``bench/results/NAME.md``, the table the
README shows between ``<!-- bench:NAME -->`` markers (``bench/_readme.py``
copies it there), so the README and the bench cannot disagree. Each table says
the commit it measured. ``HANGWATCHD_BENCH_OUT`` writes the table elsewhere (a
device run writes under ``$OUT``, whose files come back), ``HANGWATCHD_COMMIT``
names the commit where there is no git (a device's copy of the tree).

A figure whose spread over repeats is larger than its margin to the target
gets no verdict: ``spread`` says so ("noise above the target") instead of ok.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Figure:
    what: str
    figure: str
    baseline: str  # measured in the same run
    target: str  # "" where there is none
    ok: bool | None  # None where there is no target, or where the noise is larger than the target
    noisy: bool = False  # the spread over repeats is larger than the margin to the target: no verdict

    @property
    def verdict(self) -> str:
        if self.noisy:
            return "noise above the target: cannot tell"
        return "" if self.ok is None else "ok" if self.ok else "MISSED"


@dataclass(frozen=True)
class Spread:
    """Repeats of one measurement: the best, the median and the spread (max - min)."""

    values: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> float:
        return max(self.values) - min(self.values)

    def text(self, unit: str = "s", digits: int = 3) -> str:
        return (f"best {self.best:.{digits}f} {unit} of {len(self.values)} (median {self.median:.{digits}f}, "
                f"spread {self.spread:.{digits}f})")


def judged(value: float, spread: float, limit: float, higher_is_better: bool = False) -> tuple[bool | None, bool]:
    """(ok, noisy) for ``value`` against ``limit``: noisy where the limit lies within the figure's
    noise, ``value`` plus or minus half the ``spread`` (max - min) of its repeats."""
    ok = value >= limit if higher_is_better else value <= limit
    return ok, abs(value - limit) < spread / 2


def commit() -> str:
    named = os.environ.get("HANGWATCHD_COMMIT")
    if named:
        return named[:12]
    try:
        res = subprocess.run(["git", "-C", str(RESULTS.parent.parent), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else "unknown"


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "-"


def report(name: str, figures: Sequence[Figure], note: str = "", command: str | None = None) -> bool:
    """Print and write the figures; True when no target was missed."""
    for f in figures:
        target = f"; target {f.target}" if f.target else ""
        verdict = f"  {f.verdict}" if f.verdict else ""
        print(f"{name}: {f.what}: {f.figure} (baseline: {f.baseline}{target}){verdict}", flush=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["| what | figure | baseline in the same run | target | result |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {_cell(f.what)} | {_cell(f.figure)} | {_cell(f.baseline)} | {_cell(f.target)} | {_cell(f.verdict)} |"
              for f in figures]
    lines += ["", f"`{command or f'python bench/{name}.py'}`, commit {commit()}, {when}, {os.cpu_count()} cores "
              f"({platform.machine()})" + (f"; {note}" if note else "") + "."]
    out = Path(os.environ.get("HANGWATCHD_BENCH_OUT") or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return all(f.ok is not False or f.noisy for f in figures)
