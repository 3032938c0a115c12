"""A catalogue case: its script and the ``CASE`` literal at its top, read without importing it.

The scripts hang on purpose; importing one would hang the runner. So the metadata is read
with ``ast.literal_eval`` from the module's source, and checked here, once, so that a case
with a typo fails the whole run loudly instead of scoring as WRONG.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
CPU_DIR = HERE / "cases"
GPU_DIR = HERE / "gpu"
KNOWN_NEEDS = {"torch", "gpu"}
KNOWN_BESIDE = {"cpu_hog"}
REQUIRED = ("title", "source", "healthy", "watch", "ranks", "culprit", "cause", "hangs_after")


class CaseError(ValueError):
    """A case script whose CASE literal is missing or malformed."""


@dataclass(frozen=True)
class Case:
    name: str
    path: Path
    title: str
    source: str
    healthy: bool
    stack_timeout: float | None  # watched by its stack (hangwatchd run --stack-timeout)
    heartbeat_timeout: float | None  # watched by its beats (the script calls hangwatchd.beat())
    ranks: int
    culprit: tuple[str, ...]
    cause: str  # a case-insensitive regex the verdict's first sentence must match
    hangs_after: float
    observe: float = 25.0  # seconds a healthy case is watched for a false alarm
    needs: frozenset[str] = field(default_factory=frozenset)
    beside: str | None = None  # something the runner starts next to the case ("cpu_hog")
    doc: str = ""

    @property
    def gpu(self) -> bool:
        return "gpu" in self.needs


def load(path: Path) -> Case:
    """The case of one script, its CASE literal checked."""
    tree = ast.parse(path.read_text(), str(path))
    meta = _case_literal(tree, path)
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise CaseError(f"{path}: CASE lacks {', '.join(missing)}")
    watch = meta["watch"]
    if not isinstance(watch, dict) or len(watch) != 1 or not set(watch) <= {"stack_timeout", "heartbeat_timeout"}:
        raise CaseError(f"{path}: watch must be {{'stack_timeout': S}} or {{'heartbeat_timeout': S}}, not {watch!r}")
    needs = frozenset(meta.get("needs", ()))
    if not needs <= KNOWN_NEEDS:
        raise CaseError(f"{path}: unknown needs {sorted(needs - KNOWN_NEEDS)}")
    beside = meta.get("beside")
    if beside is not None and beside not in KNOWN_BESIDE:
        raise CaseError(f"{path}: unknown beside {beside!r}")
    culprit = tuple(meta["culprit"])
    if not meta["healthy"] and not culprit:
        raise CaseError(f"{path}: a hang case names at least one culprit")
    try:
        re.compile(meta["cause"])
    except re.error as exc:
        raise CaseError(f"{path}: cause is not a regex ({exc})") from None
    hangs_after = float(meta["hangs_after"])
    if not 0.5 <= hangs_after <= 3.0:
        raise CaseError(f"{path}: hangs_after {hangs_after} is outside 0.5 to 3 s")
    doc = ast.get_docstring(tree) or ""
    if not doc:
        raise CaseError(f"{path}: the script starts with a docstring saying what hangs, why, and the report")
    return Case(
        name=path.stem, path=path, title=meta["title"], source=meta["source"], healthy=bool(meta["healthy"]),
        stack_timeout=watch.get("stack_timeout"), heartbeat_timeout=watch.get("heartbeat_timeout"),
        ranks=int(meta["ranks"]), culprit=culprit, cause=meta["cause"], hangs_after=hangs_after,
        observe=float(meta.get("observe", 25.0)), needs=needs, beside=beside, doc=doc,
    )


def _case_literal(tree: ast.Module, path: Path) -> dict[str, object]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CASE" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError as exc:
                raise CaseError(f"{path}: CASE is not a literal ({exc})") from None
            if not isinstance(value, dict):
                raise CaseError(f"{path}: CASE is not a dict")
            return value
    raise CaseError(f"{path}: no module-level CASE = {{...}}")


def discover(gpu: bool = False) -> list[Case]:
    """Every case, CPU ones first, by name; with ``gpu`` the GPU ones too."""
    dirs = [CPU_DIR, GPU_DIR] if gpu else [CPU_DIR]
    return [load(p) for d in dirs for p in sorted(d.glob("*.py")) if not p.name.startswith("_")]


def select(cases: list[Case], pattern: str | None) -> list[Case]:
    """The cases whose name matches ``pattern`` (a case-insensitive regex, searched)."""
    if not pattern:
        return cases
    rx = re.compile(pattern, re.I)
    return [c for c in cases if rx.search(c.name)]
