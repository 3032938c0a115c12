"""``--check``: is each case what it says, without any daemon?

A hang case must be alive ``hangs_after + 2`` s after it starts and still at the same stack
3 s later (every rank that is still alive; a rank that is meant to exit may be gone, but not
all of them). A healthy case must be alive. Stacks are read with ``py-spy dump --native``,
compared by thread name and the (function, file) of every frame: line numbers are left out,
so that a spinning loop over two lines still counts as the same place. Ending each case must
leave no process behind.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import procs
from .cases import Case

SETTLE_S = 2.0
RECHECK_S = 3.0
Stack = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]


@dataclass(frozen=True)
class Checked:
    case: Case
    ok: bool
    detail: str


def pyspy() -> str:
    here = Path(sys.executable).parent / "py-spy"  # beside the venv's python, where ./dev puts it
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("catalogue --check: py-spy not found (it is in .venv/bin after ./dev)")
    return found


def dump(pid: int) -> Stack | None:
    """The process's threads and frames, or None when it cannot be read (gone, no rights)."""
    res = subprocess.run([pyspy(), "dump", "--pid", str(pid), "--native", "--json"], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        return None
    try:
        threads = json.loads(res.stdout)
    except ValueError:
        return None
    return tuple(sorted((str(t.get("thread_name") or t.get("thread_id")),
                         tuple((f.get("name", ""), f.get("filename", "")) for f in t.get("frames", [])))
                        for t in threads))


def workload_pid(p: subprocess.Popen[bytes]) -> int:
    return p.pid  # in --check mode the case is started as it is, no launcher above it


def check_case(case: Case, logdir: Path) -> Checked:
    run = procs.start(case, [], logdir)
    try:
        time.sleep(case.hangs_after + SETTLE_S)
        if case.healthy:
            dead = [i for i, p in enumerate(run.procs) if p.poll() is not None]
            ok, detail = (not dead, "alive" if not dead else f"rank(s) {dead} exited")
        else:
            ok, detail = _frozen(run)
    finally:
        leaks = procs.stop(run)
    if leaks:
        return Checked(case, False, f"{detail}; left behind: {'; '.join(leaks)}")
    return Checked(case, ok, detail)


def _frozen(run: procs.Running) -> tuple[bool, str]:
    alive = run.alive()
    if not alive:
        return False, f"every process exited ({[p.returncode for p in run.procs]}): it does not hang"
    before = {p.pid: dump(workload_pid(p)) for p in alive}
    time.sleep(RECHECK_S)
    moved = []
    for p in alive:
        if p.poll() is not None:
            if run.case.ranks == 1:
                moved.append(f"pid {p.pid} exited with {p.returncode}")
            continue  # a rank that leaves (as a rank meant to exit early does) is not a move of the hang
        after = dump(workload_pid(p))
        if before[p.pid] is None or after is None:
            moved.append(f"pid {p.pid} could not be read by py-spy")
        elif before[p.pid] != after:
            moved.append(f"pid {p.pid} moved: {_diff(before[p.pid], after)}")
    if not run.alive():
        return False, f"every process exited ({[p.returncode for p in run.procs]}): it does not hang"
    gone = len(run.procs) - len(run.alive())
    tail = f" ({gone} rank(s) exited, as meant)" if gone else ""
    return (not moved, "hung, same stack 3 s apart" + tail if not moved else "; ".join(moved))


def _diff(a: Stack | None, b: Stack | None) -> str:
    sa, sb = set(a or ()), set(b or ())
    changed = sorted({name for name, _ in sa ^ sb})
    return f"threads {', '.join(changed)} changed"


def check_all(cases: list[Case], jobs: int, logdir: Path) -> list[Checked]:
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda c: check_case(c, logdir), cases))
