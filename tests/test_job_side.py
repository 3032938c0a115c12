"""The job side travels light: what a job needs (hangwatchd run, hangwatchd.beat(), register()) installs
into the job's own environment with no third-party package, on Python 3.9+, and works under a real daemon
from the wheel alone (a fresh venv) and from hangwatchd-job.pyz (nothing installed)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hangwatchd
from hangwatchd.testing import ScratchDaemon, stop, wait_for
from hangwatchd.workload import bundle

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(hangwatchd.__file__).resolve().parent
# cli.py serves every command; on the job side only these of its functions run (the rest import the daemon side).
CLI_RUN_PATH = {"main", "cmd_run", "client_runtime_dir", "_not_here", "_reader_gone", "_quiet_stdout", "_loaded"}
# Names that came after Python 3.9: none may appear on the job side.
AFTER_3_9 = {"pairwise", "bit_count", "TypeAlias", "ParamSpec", "Concatenate", "TypeGuard", "Self", "Never",
             "LiteralString", "StrEnum", "TaskGroup", "ExceptionGroup", "BaseExceptionGroup", "add_note", "file_digest",
             "orig_argv", "aiter", "anext", "EncodingWarning", "hardlink_to", "tomllib", "UTC", "chdir", "process_group"}
# Where a newer name is allowed: code of the job-side modules that only the daemon side runs.
DAEMON_SIDE_CODE = {("config.py", "load")}  # the daemon's TOML file (tomllib, 3.11); a job never reads one
AFTER_3_9_KEYWORDS = {"strict", "slots", "kw_only", "key"}  # zip(strict=), dataclass(slots=, kw_only=), bisect(key=)
# A job that beats twenty times, then waits forever for a peer, in a function of its own.
JOB = ("import time, threading\nimport hangwatchd\n"
       "for _ in range(20):\n    hangwatchd.beat()\n    time.sleep(0.05)\n"
       "print('stopped beating', flush=True)\n"
       "def wait_for_the_peer():\n    threading.Event().wait()\nwait_for_the_peer()\n")


def module_of(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "hangwatchd"


def _imports(rel: str) -> tuple[set[str], list[tuple[str, bool]]]:
    """The package modules ``rel`` imports (lazily too), and each other module it imports with whether
    an ``except ImportError`` guards it. For cli.py, only what ``hangwatchd run`` executes."""
    tree = ast.parse((PACKAGE / rel).read_text())
    nodes: list[ast.AST] = [tree]
    if rel == "cli.py":
        nodes = [n for n in tree.body if not isinstance(n, ast.FunctionDef) or n.name in CLI_RUN_PATH]
    known = {module_of(str(p.relative_to(PACKAGE))) for p in PACKAGE.rglob("*.py")}
    here = module_of(rel).split(".") if rel.endswith("__init__.py") and rel != "__init__.py" else module_of(rel).split(".")[:-1]
    here = [] if rel == "__init__.py" else here
    ours: set[str] = set()
    others: list[tuple[str, bool]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Try):
            catches = any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                          for h in node.handlers)
            for stmt in node.body:
                visit(stmt, guarded or catches)
            for other in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(other, guarded)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "hangwatchd":
                    ours.add(a.name[len("hangwatchd."):] or "hangwatchd")
                else:
                    others.append((a.name.split(".")[0], guarded))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "hangwatchd":
                base = node.module.split(".")[1:]
            else:
                others.append(((node.module or "").split(".")[0], guarded))
                base = None
            if base is not None:
                for a in node.names:
                    sub = ".".join([*base, a.name])
                    ours.add(sub if sub in known else ".".join(base) or "hangwatchd")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    for n in nodes:
        visit(n, False)
    return ours, others


def test_the_job_side_is_closed_and_imports_nothing_from_outside_the_standard_library() -> None:
    listed = {module_of(rel): rel for rel in bundle.JOB_SIDE}
    # The entry points: the package, the command, the client, the launcher, and the sitecustomize the launcher
    # puts first on every job's PYTHONPATH (Python's site imports it; it loads the reporter by its directory).
    reached, todo = set(), ["hangwatchd", "__main__", "cli", "workload.client", "workload.launcher",
                            "workload.introspect.bootstrap.sitecustomize"]
    while todo:
        m = todo.pop()
        if m in reached:
            continue
        reached.add(m)
        assert m in listed, f"the job side imports {m}, which is not in workload/bundle.py's JOB_SIDE"
        ours, others = _imports(listed[m])
        parents = {".".join(m.split(".")[:i]) for i in range(1, len(m.split(".")))}
        todo += [*ours, *parents]
        unguarded = sorted({name for name, guarded in others if not guarded and name not in sys.stdlib_module_names})
        assert unguarded == [], f"{listed[m]} imports {unguarded}: the job side may import the standard library only"
    assert reached == set(listed), f"listed in JOB_SIDE but never imported: {set(listed) - reached}"


@pytest.mark.parametrize("rel", bundle.JOB_SIDE)
def test_the_job_side_reads_as_python_3_9(rel: str) -> None:
    source = (PACKAGE / rel).read_text()
    tree = ast.parse(source, feature_version=(3, 9))  # match, except*, ... would not parse
    annotations = {id(a) for root in _annotations(tree) for a in ast.walk(root)}
    if any(isinstance(a, ast.BinOp) for root in _annotations(tree) for a in ast.walk(root)):
        # X | None in an annotation is evaluated on 3.9 (a TypeError) unless annotations stay strings
        assert "from __future__ import annotations" in source, rel
    daemon_side = {id(a) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and (rel, f.name) in DAEMON_SIDE_CODE
                   for a in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in daemon_side:
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr) and id(node) not in annotations:
            text = ast.unparse(node)
            assert "None" not in text.split(" | "), f"{rel}:{getattr(node, 'lineno', '?')}: {text} is evaluated (Python 3.10+)"
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        assert name not in AFTER_3_9, f"{rel}:{getattr(node, 'lineno', '?')}: {name} is newer than Python 3.9"
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            for kw in node.keywords:
                if kw.arg in AFTER_3_9_KEYWORDS and callee.split(".")[-1] in ("zip", "dataclass", "bisect", "bisect_left",
                                                                              "bisect_right", "insort"):
                    raise AssertionError(f"{rel}:{node.lineno}: {callee}({kw.arg}=) is newer than Python 3.9")


def _annotations(tree: ast.AST) -> list[ast.AST]:
    roots: list[ast.AST] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.arg) and n.annotation is not None:
            roots.append(n.annotation)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            roots.append(n.returns)
        elif isinstance(n, ast.AnnAssign):
            roots.append(n.annotation)
    return roots


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built as ./dev wheel builds it (no network: the test environment's setuptools), from a copy."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PACKAGE, src / "hangwatchd", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                          "--wheel-dir", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (whl,) = out.glob("hangwatchd-*-py3-none-any.whl")
    return whl


def test_the_wheel_asks_for_nothing_but_python_3_9(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    assert "Requires-Python: >=3.9" in lines
    requires = [ln for ln in lines if ln.startswith("Requires-Dist:")]
    assert requires and all("extra ==" in ln for ln in requires), requires  # the daemon's all under an extra
    assert any('extra == "daemon"' in ln and "structlog" in ln for ln in requires)


def run_job(d: ScratchDaemon, launcher: list[str], python: str, job: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # From the daemon's base dir, not the checkout: `python -c` would import hangwatchd from the working directory.
    return subprocess.Popen([*launcher, "run", "--runtime-dir", str(d.runtime_dir), "--job", job, "--heartbeat-timeout", "2",
                             "--", python, "-c", JOB], env=env, stdout=subprocess.PIPE, cwd=d.base)


def assert_caught(d: ScratchDaemon, job: str) -> None:
    (inc,) = wait_for(d.settled, 40, f"the incident of job {job}")
    assert inc["job"] == job and inc["reason"] == "heartbeat", inc
    assert "wait_for_the_peer" in inc["summary"], inc["summary"]
    # The in-process reporter came with the job side (its sitecustomize, from the wheel or from inside the
    # bundle) and answered: the main thread waits on the peer's event.
    path = d.store().path_of(inc["id"])
    assert path is not None
    (proc,) = json.loads((path / "incident.json").read_text())["processes"]
    report = json.loads((path / str(proc["pid"]) / "introspect.json").read_text())
    (main,) = [t for t in report["threads"] if t["main"]]
    assert main["waits"]["kind"] == "event" and main["waits"]["where"]["function"] == "wait_for_the_peer", main["waits"]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}


def test_the_wheel_alone_in_a_fresh_venv_runs_a_job_that_a_real_daemon_watches(tmp_path: Path, wheel: Path) -> None:
    fresh = tmp_path / "job-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    py = str(fresh / "bin" / "python")
    # --no-index: were any dependency required, pip could not find it and would fail.
    res = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--quiet", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    env = clean_env()
    listed = subprocess.run([py, "-c", "import importlib.metadata as m; print(sorted(d.metadata['Name'] for d in m.distributions()))"],
                            capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path).stdout
    assert listed.strip() == "['hangwatchd']"
    # The daemon side says what it lacks, in one line.
    res = subprocess.run([str(fresh / "bin" / "hangwatchd"), "daemon"], capture_output=True, text=True, env=env, timeout=60,
                         cwd=tmp_path)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "needs the daemon's dependencies" in res.stderr and "pip install 'hangwatchd[daemon]'" in res.stderr
    with ScratchDaemon(tmp_path / "d", config={"pyspy_native": False, "gpu_dump": "never"}) as d:
        work = run_job(d, [str(fresh / "bin" / "hangwatchd")], py, "light", env)
        try:
            assert work.stdout is not None and work.stdout.readline() == b"stopped beating\n"
            assert_caught(d, "light")
            status = json.loads(subprocess.run([sys.executable, "-m", "hangwatchd", "status", "--json", "--runtime-dir",
                                                str(d.runtime_dir)], capture_output=True, text=True, timeout=60).stdout)
            (proc,) = status["processes"]
            assert proc["job"] == "light" and proc["beats"] == 20
        finally:
            stop(work)


def test_the_bundle_runs_a_job_with_nothing_installed(tmp_path: Path) -> None:
    pyz = bundle.build(tmp_path)
    with zipfile.ZipFile(pyz) as z:
        assert sorted(z.namelist()) == sorted(["__main__.py", *(f"hangwatchd/{rel}" for rel in bundle.JOB_SIDE)])
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n") and pyz.stat().st_size < 200_000
    python = shutil.which("python3", path="/usr/bin") or sys.executable  # Debian's own, outside the test venv
    env = clean_env()
    version = subprocess.run([python, "-I", str(pyz), "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert version.stdout.strip() == f"hangwatchd {hangwatchd.__version__}"
    res = subprocess.run([python, "-I", str(pyz), "status"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 1 and "not in this job-side bundle" in res.stderr and res.stderr.count("\n") == 1
    with ScratchDaemon(tmp_path / "d", config={"pyspy_native": False, "gpu_dump": "never"}) as d:
        # No PYTHONPATH from us: the launcher puts the bundle on the job's, for its `import hangwatchd`.
        work = run_job(d, [python, "-I", str(pyz)], python, "bundled", env)
        try:
            assert work.stdout is not None and work.stdout.readline() == b"stopped beating\n"
            assert_caught(d, "bundled")
        finally:
            stop(work)
