"""Copy each bench's table (bench/results/NAME.md) into README.md between its markers.

    <!-- bench:NAME -->
    ...the content of bench/results/NAME.md...
    <!-- /bench:NAME -->

Run by ``./dev bench`` after the benches; ``--check`` exits 1 where they differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKED = re.compile(r"(<!-- bench:([a-z0-9_]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def filled(readme: str, results: Path) -> str:
    def fill(m: re.Match[str]) -> str:
        table = results / f"{m.group(2)}.md"
        return m.group(1) + (table.read_text() if table.exists() else m.group(3)) + m.group(4)
    return MARKED.sub(fill, readme)


def main() -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = filled(text, ROOT / "bench" / "results")
    if "--check" in sys.argv:
        return 0 if new == text else 1
    if new != text:
        readme.write_text(new)
        print("bench: README.md's speed tables updated from bench/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
