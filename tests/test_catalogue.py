"""The hang catalogue as CI runs it: every CPU class under one real daemon, through the runner.

The gate is the runner's own (95 % right, no wrong verdict, no false alarm). It takes a few
minutes on 2 cores: deselect it for quick runs with ``-m "not catalogue"``. The quick tests
below check the scoring rule and that every case script is well-formed, without running any.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.catalogue.cases import discover
from bench.catalogue.score import FALSE_ALARM, HALF, MISSED, RIGHT, WRONG, first_sentence, score

ROOT = Path(__file__).resolve().parents[1]


def test_every_case_is_well_formed_and_cites_its_report() -> None:
    cases = discover(gpu=True)
    hangs = [c for c in cases if not c.healthy and not c.gpu]
    assert len(hangs) >= 40 and sum(c.healthy for c in cases) >= 6 and sum(c.gpu for c in cases) >= 5
    for c in cases:
        assert "#" in c.source and "#" in c.doc, f"{c.name}: cite the report (tracker#number)"


def test_the_first_sentence_keeps_a_leading_label_and_stops_at_the_next_sentence() -> None:
    assert first_sentence("pid 5: deadlock between a (f, x.py:3) and b.\nRank 0: waiting.") == "pid 5: deadlock between a (f, x.py:3) and b."
    assert first_sentence("Rank 1 exited with status 0 at 10:53:20 UTC, 4.5 s before rank 0 stopped. Rank 0: x") == \
        "Rank 1 exited with status 0 at 10:53:20 UTC, 4.5 s before rank 0 stopped."
    assert first_sentence("A waits in ncclGroupEnd: look at that rank first (OOM). Here: Rank 0: x") == \
        "A waits in ncclGroupEnd: look at that rank first (OOM)."


def test_scoring_reads_names_not_file_names() -> None:
    rule = (("rank 1", "wait_for_upload"), "sleep", False)
    assert score("Rank 1 sleeps in wait_for_upload (a.py:3).", *rule).result == RIGHT
    assert score("Rank 1: waiting at wait_for_upload (/x/rank_sleeps.py:3).", *rule).result == HALF
    assert score("pid 3: idle at main (/x/rank_sleeps.py:3). Rank 1 is in wait_for_upload.", *rule).result == HALF
    assert score("pid 3: idle at main (/x/rank_sleeps.py:3).", *rule).result == WRONG
    assert score(None, *rule).result == MISSED
    assert score("pid 3: hung.", (), "", True).result == FALSE_ALARM and score(None, (), "", True).result == RIGHT


@pytest.mark.catalogue
def test_the_cpu_catalogue_passes_its_gate(tmp_path: Path) -> None:
    out = tmp_path / "catalogue.json"
    res = subprocess.run([sys.executable, "-m", "bench.catalogue", "--jobs", "5", "--json", str(out), "--no-write"],
                         cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert out.exists(), f"the runner produced no result (exit {res.returncode}):\n{res.stderr[-4000:]}"
    summary = json.loads(out.read_text())["summary"]
    table = "\n".join(line for line in res.stdout.splitlines() if line.strip())
    assert summary["passed"] and res.returncode == 0, f"the catalogue's gate failed:\n{table}\n{res.stderr[-2000:]}"
