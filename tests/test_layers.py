"""The house's floors: a stage imports the stages before it, never one after (docs/design.md, Rooms).

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

# The order, written once, bottom floor first, following the flow a process passes through:
# register -> watch -> detect -> capture -> analyse -> store -> the fleet -> export, with the daemon
# that wires them and the command line on top. A module may import its own floor and the ones below
# it. On the ground: the records, the settings, the metrics, the log, the host's OS facts and the
# coredump reader, which import nothing above the ground. The README's Rooms table is checked
# against this list and the tree (test_the_readme_rooms_table_is_the_tree).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("model", "config", "metrics", "log", "host", "host.*", "cudacore", "cudacore.*", "fleet.url")),
    ("workload", ("hangwatchd", "workload", "workload.*")),
    ("watch", ("watch", "watch.*")),
    ("detect", ("detect", "detect.*")),
    ("capture", ("capture", "capture.*")),
    ("analyse", ("analyze", "analyze.*")),
    ("incidents", ("incidents", "incidents.*")),
    ("fleet", ("fleet", "fleet.*")),
    ("report", ("report", "report.*")),
    ("daemon", ("daemon", "daemon.*")),
    ("cli", ("cli", "cli_parser", "__main__", "check", "demo", "demo.*", "testing")),
]

# At most this many modules loose at the top of the package; the rest live in the stage they serve.
MAX_LOOSE = 10


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


def import_loops(root: Path) -> list[str]:
    """Each set of modules that import one another, lazily or not, as one line 'a -> b -> a'.

    A package and its own submodules count like any other pair: ``capture/__init__`` may
    gather its steps, and a step must then not import ``capture`` back."""
    graph = {module_name(root, p): sorted(imports_of(root, p)) for p in sorted(root.rglob("*.py"))}
    loops: list[str] = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(" -> ".join(sorted(comp) + [sorted(comp)[0]]))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(loops)


# Reports render an analysis they are given (the CLI, or the store's page writer, computes it):
# a report module may read an incident's files, never run the verdict.
VERDICT = "analyze.verdict"


def reports_that_compute(root: Path) -> list[str]:
    return [f"{module_name(root, p)} imports {VERDICT}" for p in sorted((root / "report").rglob("*.py"))
            if VERDICT in imports_of(root, p)]


def test_no_stage_imports_a_later_one() -> None:
    root = Path(hangwatchd.__file__).parent
    assert violations(root, FLOORS) == []


def test_no_module_imports_another_that_imports_it_back() -> None:
    assert import_loops(Path(hangwatchd.__file__).parent) == []


def test_few_modules_are_loose_at_the_top() -> None:
    loose = sorted(p.name for p in Path(hangwatchd.__file__).parent.glob("*.py"))
    assert len(loose) <= MAX_LOOSE, loose


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
        "__init__.py": "from .workload.client import beat\n",
        "workload/__init__.py": "",
        "workload/client.py": "from .. import model\n",
        "model.py": "",
        "incidents/__init__.py": "",
        "incidents/store.py": "from ..model import Incident\n",
        "capture/__init__.py": "",
        "capture/base.py": "from ..model import Registration\n",
        # capture knowing the later stages, the second one lazily inside a function
        "capture/pipeline.py": ("from ..analyze.verdict import analyze\nfrom .base import Step\n\n"
                                "def run():\n    from hangwatchd.incidents import store\n    return store\n"),
        "analyze/__init__.py": "",
        "analyze/verdict.py": "from ..capture import base\nfrom .gone import account\n",
        # two modules that import each other, one of them lazily: a loop
        "analyze/gone.py": "def account():\n    from .verdict import Analysis\n",
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
        "capture.pipeline (capture) imports incidents.store (incidents), a later stage",
        "metrics (ground) imports report.incident (report), a later stage",
        "newroom: on no floor; add it to FLOORS in tests/test_layers.py",
    ]


def test_the_check_fails_on_an_import_loop(bad_house: Path) -> None:
    assert import_loops(bad_house) == ["analyze.gone -> analyze.verdict -> analyze.gone"]


def test_the_check_fails_on_a_report_that_runs_the_analysis(bad_house: Path) -> None:
    assert reports_that_compute(bad_house) == ["report.incident imports analyze.verdict"]


def test_imports_are_resolved_as_python_does(bad_house: Path) -> None:
    assert imports_of(bad_house, bad_house / "capture" / "pipeline.py") == {"analyze.verdict", "capture.base", "incidents.store"}
    assert imports_of(bad_house, bad_house / "__init__.py") == {"workload.client"}
    assert imports_of(bad_house, bad_house / "analyze" / "verdict.py") == {"capture.base", "analyze.gone"}
    assert imports_of(bad_house, bad_house / "metrics.py") == {"report.incident"}


def test_the_readme_rooms_table_is_the_tree() -> None:
    """Every package and loose module of hangwatchd/ is a row of the README's Rooms table, and
    every name in the table exists."""
    root = Path(hangwatchd.__file__).parent
    readme = (root.parent / "README.md").read_text()
    table = readme.split("## Rooms: where the code lives", 1)[1].split("\n## ", 1)[0]
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    named = {name.strip("`/ ") for cell in first_cells for name in cell.split(",")}
    tree = {p.stem for p in root.glob("*.py") if p.stem not in ("__init__", "__main__")}
    tree |= {p.parent.name for p in root.glob("*/__init__.py")}
    assert named == tree
