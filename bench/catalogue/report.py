"""What the catalogue prints and writes: a line per class, a summary, a markdown table.

The table goes to ``bench/results/catalogue.md`` (``HANGWATCHD_BENCH_OUT`` writes it
elsewhere, as every bench does), footed like the other benches' tables: the command, the
commit it measured, when, and the machine (``_figures.machine``).
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from .score import FALSE_ALARM, HALF, MISSED, RIGHT, SKIPPED, WRONG
from .watch import Outcome

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _figures as figures
from _figures import RESULTS

GATE_RIGHT_PCT = 95.0
LINE_WIDTH = 110


@dataclass(frozen=True)
class Summary:
    counts: dict[str, int]
    scored: int  # every case that ran (not skipped)
    right_pct: float
    median_s: float | None  # median seconds from hang to incident, over the hang cases that got one

    @property
    def passed(self) -> bool:
        return self.scored > 0 and self.right_pct >= GATE_RIGHT_PCT and not self.counts[WRONG] and not self.counts[FALSE_ALARM]

    def line(self) -> str:
        c = self.counts
        median = f", median {self.median_s:.1f} s from hang to incident" if self.median_s is not None else ""
        return (f"catalogue: {self.right_pct:.1f} % right ({c[RIGHT]} of {self.scored}): {c[HALF]} half, {c[WRONG]} wrong, "
                f"{c[MISSED]} missed, {c[FALSE_ALARM]} false alarms, {c[SKIPPED]} skipped{median}; "
                f"gate: >= {GATE_RIGHT_PCT:g} % right, no wrong, no false alarm: {'passed' if self.passed else 'FAILED'}")


def summarise(outcomes: list[Outcome]) -> Summary:
    counts = {k: 0 for k in (RIGHT, HALF, WRONG, MISSED, FALSE_ALARM, SKIPPED)}
    for o in outcomes:
        counts[o.result] += 1
    scored = len(outcomes) - counts[SKIPPED]
    secs = [o.seconds for o in outcomes if o.seconds is not None and not o.case.healthy]
    return Summary(counts, scored, 100.0 * counts[RIGHT] / scored if scored else 0.0,
                   statistics.median(secs) if secs else None)


def console_line(o: Outcome) -> str:
    secs = f"{o.seconds:6.1f}s" if o.seconds is not None else "     - "
    said = o.first or o.note
    text = f"{o.case.name:<38} {o.result:<11} {secs}  {said}"
    return text if len(text) <= LINE_WIDTH else text[: LINE_WIDTH - 1] + "…"


def expected(o: Outcome) -> str:
    c = o.case
    if c.healthy:
        return f"healthy: {c.title}; no incident"
    return f"{c.title}; culprit {' or '.join(c.culprit)}; cause /{c.cause}/"


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split()) or "-"


def markdown(outcomes: list[Outcome], summary: Summary, command: str, elapsed_s: float) -> str:
    lines = ["| class | expected | result | s to incident | verdict (first sentence in bold) |",
             "| --- | --- | --- | --- | --- |"]
    for o in outcomes:
        secs = f"{o.seconds:.1f}" if o.seconds is not None else "-"
        shown = _verdict_cell(o)
        lines.append(f"| {_cell(o.case.name)} | {_cell(expected(o))} | {o.result} | {secs} | {shown} |")
    lines += ["", summary.line(), "", provenance(command, len(outcomes), elapsed_s)]
    return "\n".join(lines) + "\n"


def provenance(command: str, classes: int, elapsed_s: float) -> str:
    """What ran, on which commit and machine, when: the last line of every table the catalogue writes."""
    return f"{figures.provenance(command)}; {classes} classes under one daemon in {elapsed_s:.0f} s."


def _verdict_cell(o: Outcome) -> str:
    if not o.verdict:
        return _cell(o.note)
    rest = " ".join(o.verdict.split())[len(o.first):].strip()
    return f"**{_cell(o.first)}**" + (f" {_cell(rest)}" if rest else "") + (f" ({_cell(o.note)})" if o.note else "")


def verdict_table(outcomes: list[Outcome], summary: Summary, command: str, elapsed_s: float) -> str:
    """The README's table of verdicts: one row per kind the catalogue's right answers gave, each with
    the class it came from and the verdict as printed (its first sentence)."""
    rows: dict[str, Outcome] = {}
    for o in outcomes:
        if o.result == RIGHT and o.verdict and o.kind and o.kind not in rows:
            rows[o.kind] = o
    lines = ["| the cause (a catalogue class) | kind | the verdict says |", "| --- | --- | --- |"]
    for kind, o in sorted(rows.items(), key=lambda kv: kv[1].case.name):
        lines.append(f"| {_cell(o.case.title)} | `{kind}` | {_cell(o.first)} |")
    healthy = [o for o in outcomes if o.case.healthy and o.result == RIGHT]
    if healthy:
        lines.append(f"| {len(healthy)} healthy look-alikes ({', '.join(o.case.name.removeprefix('healthy_') for o in healthy)}) "
                     "| - | no incident |")
    return "\n".join(lines + ["", summary.line(), "", provenance(command, len(outcomes), elapsed_s)]) + "\n"


def write(text: str, name: str = "catalogue") -> Path:
    out = Path(os.environ.get("HANGWATCHD_BENCH_OUT") or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.md"
    path.write_text(text)
    return path
