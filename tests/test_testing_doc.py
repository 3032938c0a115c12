"""docs/testing-your-setup.md's example is what a user would paste into their own tests: it runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_documented_example_passes_as_written(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "testing-your-setup.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(code, "docs/testing-your-setup.md", "exec"), scope)  # our own document
    tests = [v for k, v in scope.items() if k.startswith("test_") and callable(v)]
    assert len(tests) == 1
    tests[0](tmp_path)
