"""The house's floors: a stage imports the stages before it, never one after (DESIGN.md, Rooms).

Every module of ``hangwatchd`` is read with ``ast`` (lazy imports inside
functions count too) and placed on a floor; an import of a module on a higher
floor fails the test, and so does a module that has no floor yet (a new file
says where it lives by being added below).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hangwatchd

# The order, written once, bottom floor first. A module may import its own floor and the ones
# below it. DESIGN.md's five floors: on the ground the model, the coredump reader, metrics,
# config and the beat segment (and the small helpers they share), which import nothing above
# the ground; then the stages (capture, analysis, reports, the store, the registry and the
# client), which follow the flow among themselves, register -> watch -> capture -> analyse ->
# store -> export (symbolising is the coredump reader's, on the ground); then the detectors and
# the launcher; then the daemon and the rooms it hands work to; and the command line on top.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("model", "config", "metrics", "heartbeat", "cudacore", "cudacore.*", "untrusted", "procfs",
                "subproc", "samples", "patterns", "notify", "log", "runtime", "incident_access", "user_limits", "jsonfile",
                "pdeathsig", "fleet.url")),
    ("register", ("hangwatchd", "registry", "client", "exits")),
    ("watch", ("watched", "ranks")),
    ("capture", ("capture", "capture.*", "gpudump")),
    ("analyse", ("analyze", "analyze.*")),
    ("store", ("store", "spool", "retention", "fleet", "fleet.*")),
    ("export", ("report", "report.*")),
    ("detect and launch", ("detect", "detect.*", "launcher")),
    ("daemon", ("daemon", "loop_guard", "instance_lock", "registrations", "capture_workers", "make_incident", "dump_ingest", "dumpscan",
                "status_file")),
    ("cli", ("cli", "cli_parser", "__main__", "check", "demo", "demo_workload", "testing", "fleet.testing")),
]


def module_name(root: Path, path: Path) -> str:
    """'capture.pipeline' for ROOT/capture/pipeline.py; the package's own __init__ is its name."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or root.name


def floor_of(module: str, floors: list[tuple[str, tuple[str, ...]]]) -> int | None:
    """The floor a module is placed on: by its exact name first, else by the longest 'package.*'."""
    best: tuple[int, int] | None = None  # (specificity, floor)
    for level, (_name, patterns) in enumerate(floors):
        for pattern in patterns:
            if pattern == module:
                return level
            if pattern.endswith(".*") and module.startswith(pattern[:-1]):
                if best is None or len(pattern) > best[0]:
                    best = (len(pattern), level)
    return best[1] if best else None


def imports_of(root: Path, path: Path) -> set[str]:
    """The package's modules that ``path`` imports, by module name (relative and absolute imports)."""
    package = root.name
    me = module_name(root, path)
    here = me.split(".") if path.name == "__init__.py" and me != package else me.split(".")[:-1]
    if me == package:
        here = []
    known = {module_name(root, p) for p in root.rglob("*.py")}
    out: set[str] = set()

    def add(dotted: list[str], names: list[str]) -> None:
        base = ".".join(dotted) or package
        for name in names:
            sub = f"{base}.{name}" if dotted else name
            out.add(sub if sub in known else base)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    out.add(alias.name[len(package) + 1:] or package)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                dotted = here[: len(here) - (node.level - 1)] if node.level > 1 else list(here)
                if node.module:
                    dotted += node.module.split(".")
            elif node.module and (node.module == package or node.module.startswith(package + ".")):
                dotted = node.module.split(".")[1:]
            else:
                continue
            add(dotted, [a.name for a in node.names])
    out.discard(me)
    return out


def violations(root: Path, floors: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """One line for each import of a higher floor, and for each module placed on none."""
    found = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(root, path)
        mine = floor_of(me, floors)
        if mine is None:
            found.append(f"{me}: on no floor; add it to FLOORS in tests/test_layers.py")
            continue
        for other in sorted(imports_of(root, path)):
            theirs = floor_of(other, floors)
            if theirs is not None and theirs > mine:
                found.append(f"{me} ({floors[mine][0]}) imports {other} ({floors[theirs][0]}), a later stage")
    return found


# Reports render an analysis they are given (the CLI, or the store's page writer, computes it):
# a report module may read an incident's files, never run the verdict.
VERDICT = "analyze.verdict"


def reports_that_compute(root: Path) -> list[str]:
    return [f"{module_name(root, p)} imports {VERDICT}" for p in sorted((root / "report").rglob("*.py"))
            if VERDICT in imports_of(root, p)]


def test_no_stage_imports_a_later_one() -> None:
    root = Path(hangwatchd.__file__).parent
    assert violations(root, FLOORS) == []


def test_every_floor_of_the_order_is_in_use() -> None:
    root = Path(hangwatchd.__file__).parent
    used = {floor_of(module_name(root, p), FLOORS) for p in root.rglob("*.py")}
    assert used == set(range(len(FLOORS)))


def test_reports_render_an_analysis_they_are_given() -> None:
    assert reports_that_compute(Path(hangwatchd.__file__).parent) == []


@pytest.fixture
def bad_house(tmp_path: Path) -> Path:
    """A small package with the arrows this check exists to catch (the ones issue 13 found)."""
    root = tmp_path / "hangwatchd"
    files = {
        "__init__.py": "from .client import beat\n",
        "client.py": "from . import model\n",
        "model.py": "",
        "store.py": "from .model import Incident\n",
        "capture/__init__.py": "",
        "capture/base.py": "from ..model import Registration\n",
        # capture knowing the later stages, the second one lazily inside a function
        "capture/pipeline.py": ("from ..analyze.verdict import analyze\nfrom .base import Step\n\n"
                                "def run():\n    from hangwatchd import store\n    return store\n"),
        "analyze/__init__.py": "",
        "analyze/verdict.py": "from ..capture import base\n",
        # a report that runs the analysis is fine by floors (export after analyse), caught apart...
        "report/__init__.py": "",
        "report/incident.py": "from ..analyze.verdict import analyze\n",
        # ...but the ground importing a stage is not
        "metrics.py": "import hangwatchd.report.incident\n",
        "newroom.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_check_fails_on_a_later_stage_imported(bad_house: Path) -> None:
    assert violations(bad_house, FLOORS) == [
        "capture.pipeline (capture) imports analyze.verdict (analyse), a later stage",
        "capture.pipeline (capture) imports store (store), a later stage",
        "metrics (ground) imports report.incident (export), a later stage",
        "newroom: on no floor; add it to FLOORS in tests/test_layers.py",
    ]


def test_the_check_fails_on_a_report_that_runs_the_analysis(bad_house: Path) -> None:
    assert reports_that_compute(bad_house) == ["report.incident imports analyze.verdict"]


def test_imports_are_resolved_as_python_does(bad_house: Path) -> None:
    assert imports_of(bad_house, bad_house / "capture" / "pipeline.py") == {"analyze.verdict", "capture.base", "store"}
    assert imports_of(bad_house, bad_house / "__init__.py") == {"client"}
    assert imports_of(bad_house, bad_house / "analyze" / "verdict.py") == {"capture.base"}
    assert imports_of(bad_house, bad_house / "metrics.py") == {"report.incident"}
