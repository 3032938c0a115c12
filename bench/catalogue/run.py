#!/usr/bin/env python3
"""Run the hang catalogue under one real daemon and score every verdict.

Each class is a script under ``cases/`` (``gpu/`` with ``--gpu``) that really hangs the way a
user report says, with its expected culprit and cause in a ``CASE`` literal. All of them run
under ONE ``hangwatchd daemon`` (several at a time), each through ``hangwatchd run`` with its
own job name; a class is RIGHT when the first sentence of its incident's verdict names a
culprit and matches the cause, HALF when only one of the two does (or the culprit comes only
later), WRONG when neither, MISSED when no incident came within 60 s of the hang. A healthy
look-alike is RIGHT when no incident comes while it is watched, FALSE ALARM otherwise.

Exits 1 below 95 % right or on any WRONG or FALSE ALARM (``--no-fail``: report only).
``--check`` runs no daemon: it checks that every case really hangs (py-spy, the same stack
3 s apart) or, healthy, stays alive.

examples:
  .venv/bin/python bench/catalogue/run.py
  .venv/bin/python -m bench.catalogue -k 'lock|deadlock' --jobs 3 --no-fail
  .venv/bin/python -m bench.catalogue --check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``bench.catalogue`` and ``hangwatchd`` importable
    ROOT = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(ROOT)]
    __package__ = "bench.catalogue"

try:
    from hangwatchd.testing import ScratchDaemon
except ImportError as exc:  # a python without the project's dependencies (the shebang's python3)
    raise SystemExit(f"catalogue: {exc}; run it with the project's venv: .venv/bin/python bench/catalogue/run.py "
                     "(./dev sets .venv up)") from None

from . import check, report
from .cases import Case, CaseError, discover, select
from .watch import Outcome, run_case, skipped

# Stacks sampled every second so that a 5 s stack timeout is judged on 5 samples; captures and
# incidents never throttled (the per-user budgets are for other users' floods, and a run as a
# non-root user would otherwise be cut at 6 incidents a minute); no GPU dump on a CPU run.
DAEMON_CONFIG: dict[str, object] = {
    "stack_interval": 1.0, "incidents_per_uid_per_minute": 10000, "captures_per_uid": 8,
    "capture_seconds_per_uid": 1e6, "pyspy_samples_per_uid": 1000.0, "max_registrations_per_uid": 1000,
    "log_lines_per_uid_per_minute": 100000,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/catalogue/run.py", description=__doc__.split("\n\n")[0],
                                 epilog="examples:" + __doc__.split("examples:")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", dest="pattern", metavar="PATTERN", help="only the classes whose name matches this regex")
    ap.add_argument("--jobs", type=int, default=5, help="classes run at once (default: 5)")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write every outcome as JSON to FILE")
    ap.add_argument("--no-fail", action="store_true", help="report only: exit 0 whatever the score")
    ap.add_argument("--check", action="store_true", help="no daemon: check every case really hangs (or stays alive)")
    ap.add_argument("--gpu", action="store_true", help="also the GPU classes under gpu/ (on a GPU machine)")
    ap.add_argument("--no-write", action="store_true", help="do not write bench/results/catalogue.md")
    ap.add_argument("--workdir", type=Path, metavar="DIR",
                    help="keep the daemon's state, incidents and the cases' output in DIR (default: a temporary dir, removed)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    return args


def missing_need(case: Case) -> str | None:
    """Why the case cannot run here, or None."""
    if "torch" in case.needs or "gpu" in case.needs:
        if importlib.util.find_spec("torch") is None:
            return "needs torch, which is not importable here (.venv/bin/pip install torch)"
    if "gpu" in case.needs:
        # NCCL puts each rank on its own GPU ("Duplicate GPU detected" otherwise): a GPU per rank.
        probe = subprocess.run([sys.executable, "-c", f"import torch, sys; sys.exit(0 if torch.cuda.device_count() >= {case.ranks} else 1)"],
                               capture_output=True, timeout=120)
        if probe.returncode != 0:
            return f"needs {case.ranks} CUDA GPUs (one per rank), fewer are visible" if case.ranks > 1 else "needs a CUDA GPU, none is visible"
    return None


def run_all(cases: list[Case], jobs: int, workdir: Path) -> list[Outcome]:
    """Every case under one daemon, ``jobs`` at a time, in the order given."""
    tag = uuid.uuid4().hex[:6]
    config = dict(DAEMON_CONFIG)
    if not any(c.gpu for c in cases):
        config["gpu_dump"] = "never"
    todo = [(c, missing_need(c)) for c in cases]
    with ScratchDaemon(workdir / "daemon", config=config) as d:
        def one(item: tuple[Case, str | None]) -> Outcome:
            case, why = item
            out = skipped(case, why) if why else run_case(d, case, workdir / "logs", tag)
            print(report.console_line(out), flush=True)
            return out

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, _longest_first(todo)))


def _longest_first(todo: list[tuple[Case, str | None]]) -> list[tuple[Case, str | None]]:
    # Healthy cases are watched for their whole observation and ranks start slowly: start those
    # first so that the short ones fill the gaps, and the run ends sooner.
    return sorted(todo, key=lambda t: (-(t[0].observe if t[0].healthy else 0) - 10 * (t[0].ranks > 1), t[0].name))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        cases = select(discover(gpu=args.gpu), args.pattern)
    except CaseError as exc:
        print(f"catalogue: {exc}", file=sys.stderr)
        return 2
    if not cases:
        print(f"catalogue: no class matches {args.pattern!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hangwatchd-catalogue-") as tmp:
        work = args.workdir or Path(tmp)
        if args.check:
            return _check(cases, args, work)
        t0 = time.monotonic()
        outcomes = run_all(cases, args.jobs, work)
        elapsed = time.monotonic() - t0
    order = {c.name: i for i, c in enumerate(cases)}
    outcomes.sort(key=lambda o: order[o.case.name])
    summary = report.summarise(outcomes)
    print(summary.line(), flush=True)
    print(f"catalogue: {len(outcomes)} classes in {elapsed:.0f} s", flush=True)
    command = "python -m bench.catalogue" + (f" -k '{args.pattern}'" if args.pattern else "") + (" --gpu" if args.gpu else "")
    if not args.no_write:
        path = report.write(report.markdown(outcomes, summary, command, elapsed), "catalogue_gpu" if args.gpu else "catalogue")
        print(f"catalogue: table written to {path}", flush=True)
        # The README's tables of verdicts: from a whole CPU run, and from a run of the GPU classes alone.
        table = "verdicts" if not args.pattern and not args.gpu else "verdicts_gpu" if all(c.gpu for c in cases) else None
        if table:
            print(f"catalogue: verdicts written to {report.write(report.verdict_table(outcomes, summary, command, elapsed), table)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"summary": {**summary.counts, "right_pct": summary.right_pct,
                                                     "median_s": summary.median_s, "passed": summary.passed,
                                                     "elapsed_s": round(elapsed, 1)},
                                         "classes": [o.as_json() for o in outcomes]}, indent=1) + "\n")
    leaks = [x for o in outcomes for x in o.leaks]
    if leaks:
        print(f"catalogue: {len(leaks)} processes escaped their case and were killed: {leaks}", file=sys.stderr)
    return 0 if args.no_fail or (summary.passed and not leaks) else 1


def _check(cases: list[Case], args: argparse.Namespace, tmp: Path) -> int:
    runnable = []
    for c in cases:
        why = missing_need(c)
        if why:
            print(f"{c.name:<38} SKIPPED  {why}", flush=True)
        else:
            runnable.append(c)
    results = check.check_all(runnable, args.jobs, tmp / "logs")
    for r in results:
        print(f"{r.case.name:<38} {'ok' if r.ok else 'NOT OK':<8} {r.detail}", flush=True)
    bad = [r for r in results if not r.ok]
    print(f"catalogue --check: {len(results) - len(bad)} of {len(results)} cases are what they say", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
