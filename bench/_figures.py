"""What every bench prints and writes: each figure with its same-run baseline, its target and ok/MISSED.

``report`` prints the lines and writes ``bench/results/NAME.md``, the table the
README shows between ``<!-- bench:NAME -->`` markers (``bench/_readme.py``
copies it there), so the README and the bench cannot disagree. Each table says
the commit it measured and the machine it ran on (``machine``: the CPU's model,
its cores and architecture, and the GPUs the NVIDIA driver lists). ``HANGWATCHD_BENCH_OUT`` writes the table elsewhere (a
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
    """The commit measured: ``HANGWATCHD_COMMIT`` where there is no git (a device's copy), else git's
    HEAD, said to have uncommitted changes where the code measured (the package, the benches, the
    dependencies' pins) differs from it."""
    named = os.environ.get("HANGWATCHD_COMMIT")
    if named:
        return named[:12]
    root = str(RESULTS.parent.parent)
    try:
        res = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", "hangwatchd",
                                "bench", ":!bench/results", "pyproject.toml", "constraints.txt"],
                               capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    if res.returncode != 0 or not res.stdout.strip():
        return "unknown"
    return res.stdout.strip() + (" with uncommitted changes" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def machine() -> str:
    """The machine a figure was measured on, in a few words: "AMD EPYC, 2 cores (x86_64)", with
    ", 1 x NVIDIA H200" where the NVIDIA driver lists GPUs."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    gpus: list[str] = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            gpus += [line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("Model:")]
        except OSError:
            continue
    named = ", ".join(f"{gpus.count(g)} x {g}" for g in dict.fromkeys(gpus))
    return f"{model + ', ' if model else ''}{os.cpu_count()} cores ({platform.machine()})" + (f", {named}" if named else "")


STARTED_ON = commit()  # the code a bench runs is the code there when it started (a long run may see HEAD move)


def provenance(command: str) -> str:
    """What ran, on which commit and machine, and when: the start of every table's last line."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    now = commit()
    moved = "" if now == STARTED_ON else f" (HEAD moved to {now} while it ran)"
    return f"`{command}`, commit {STARTED_ON}{moved}, {when}, on {machine()}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "-"


def report(name: str, figures: Sequence[Figure], note: str = "", command: str | None = None) -> bool:
    """Print and write the figures; True when no target was missed."""
    for f in figures:
        target = f"; target {f.target}" if f.target else ""
        verdict = f"  {f.verdict}" if f.verdict else ""
        print(f"{name}: {f.what}: {f.figure} (baseline: {f.baseline}{target}){verdict}", flush=True)
    lines = ["| what | figure | baseline in the same run | target | result |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {_cell(f.what)} | {_cell(f.figure)} | {_cell(f.baseline)} | {_cell(f.target)} | {_cell(f.verdict)} |"
              for f in figures]
    lines += ["", provenance(command or f"python bench/{name}.py") + (f"; {note}" if note else "") + "."]
    out = Path(os.environ.get("HANGWATCHD_BENCH_OUT") or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return all(f.ok is not False or f.noisy for f in figures)
