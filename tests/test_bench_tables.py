"""The README's speed tables are the benches' own output: bench/results/NAME.md, copied between markers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("[!_]*.py"))


def test_every_bench_has_committed_results_with_a_verdict_per_target() -> None:
    assert BENCHES
    for name in BENCHES:
        table = (ROOT / "bench" / "results" / f"{name}.md").read_text()
        assert table.startswith("| what | figure | baseline in the same run | target | result |"), name
        rows = [r for r in table.splitlines()[2:] if r.startswith("| ")]
        assert rows, name
        for row in rows:
            target, result = [c.strip() for c in row.strip("|").split(" | ")][3:5]
            verdicts = ("ok", "MISSED", "noise above the target: cannot tell")
            assert result in verdicts if target != "-" else result == "-", (name, row)


def test_every_table_names_the_commit_and_the_machine_it_was_measured_on() -> None:
    tables = sorted((ROOT / "bench" / "results").glob("*.md"))
    assert tables
    for table in tables:
        last = [line for line in table.read_text().splitlines() if line.strip()][-1]
        assert re.search(r"commit [0-9a-f]{7,}", last), f"{table.name} names no commit: {last}"
        assert re.search(r"\d+ cores \(\w+\)", last), f"{table.name} names no machine: {last}"


def test_the_readme_shows_exactly_what_the_committed_results_say() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in BENCHES:
        m = re.search(rf"<!-- bench:{name} -->\n(.*?)<!-- /bench:{name} -->", readme, re.S)
        assert m, f"README.md has no <!-- bench:{name} --> table"
        assert m.group(1) == (ROOT / "bench" / "results" / f"{name}.md").read_text(), f"README's {name} table differs; run ./dev bench"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "_readme.py"), "--check"], capture_output=True, timeout=60)
    assert res.returncode == 0


def test_the_copy_replaces_a_stale_table(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from _readme import filled
    finally:
        sys.path.remove(str(ROOT / "bench"))
    (tmp_path / "detect.md").write_text("| new |\n")
    stale = "x\n<!-- bench:detect -->\n| old: 3.00 s |\n<!-- /bench:detect -->\ny\n"
    assert filled(stale, tmp_path) == "x\n<!-- bench:detect -->\n| new |\n<!-- /bench:detect -->\ny\n"
