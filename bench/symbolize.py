"""How long symbolising a dump takes the way the daemon does it (a limited child forked
from the warm fork server), against cuda-gdb --batch on the same dump in the same run,
and against `hangwatchd symbolize --json` (a fresh interpreter, in-process) as the baseline.

    .venv/bin/python bench/symbolize.py                 # every fixture dump
    .venv/bin/python bench/symbolize.py DUMP [DUMP...]  # any dumps (raw or .xz/.gz/.zst)

One row per dump: seconds of each (best of RUNS), the ratio cuda-gdb / child (higher is
better for us), the target, and ok or MISSED. Without cuda-gdb the ratio is n/a.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd.cudacore import sandbox  # noqa: E402
from hangwatchd.cudacore.cudagdb import cuda_gdb_argv, find_cuda_gdb  # noqa: E402
from hangwatchd.cudacore.source import raw_path  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
RUNS = 3
TARGET = 2.0  # issue 10: the limited child at least twice as fast as cuda-gdb on every dump


def timed_process(argv: list[str]) -> tuple[float, float]:
    """Best wall time of RUNS runs, and the peak RSS (MB) of the process."""
    best, peak = float("inf"), 0.0
    for _ in range(RUNS):
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        best = min(best, time.perf_counter() - start)
        peak = max(peak, usage.ru_maxrss / 1024)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{argv} failed")
    return best, peak


def timed_child(path: Path) -> tuple[float, float]:
    """(first call, best of RUNS) through the sandbox, with the daemon's default limits."""
    times = []
    for _ in range(RUNS + 1):
        start = time.perf_counter()
        sandbox.symbolize(path)
        times.append(time.perf_counter() - start)
    return times[0], min(times[1:])


def dumps(args: list[str]) -> list[tuple[str, Path]]:
    if args:
        return [((Path(a).parent.name if Path(a).name.startswith("coredump.") else Path(a).name.split(".")[0])[:20], Path(a))
                for a in args]
    return [(xz.parent.name, xz) for xz in sorted(FIXTURES.glob("*/coredump.nvcudmp.xz"))]


def main() -> None:
    gdb = find_cuda_gdb()
    sandbox.start()
    missed = 0
    print(f"{'dump':<20} {'MB':>6} {'child s':>8} {'(first)':>8} {'cli s':>6} {'cli MB':>7} {'cuda-gdb s':>10} "
          f"{'ratio':>6} {'target':>7}  result")
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in dumps(sys.argv[1:]):
            # Raw on disk, as the driver writes it: decompression is not what is measured.
            # Streamed, never held here: a forked child's peak RSS starts from this process's.
            raw = Path(tmp) / f"{name}.nvcudmp"
            with raw_path(src) as plain, open(plain, "rb") as fin, open(raw, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            first, child = timed_child(raw)
            cli, mem = timed_process([sys.executable, "-m", "hangwatchd", "symbolize", "--json", str(raw)])
            theirs = timed_process(cuda_gdb_argv(gdb, str(raw)))[0] if gdb else None
            ratio = theirs / child if theirs else None
            result = "n/a" if ratio is None else ("ok" if ratio >= TARGET else "MISSED")
            missed += result == "MISSED"
            print(f"{name:<20} {raw.stat().st_size / 1e6:6.1f} {child:8.3f} {first:8.3f} {cli:6.2f} {mem:7.0f} "
                  f"{(f'{theirs:10.2f}' if theirs else '       n/a')} {(f'{ratio:5.2f}x' if ratio else '   n/a')} "
                  f"{f'>={TARGET:g}x':>7}  {result}")
    sandbox.stop()
    if not gdb:
        print("cuda-gdb is not installed here: the ratio (cuda-gdb s / child s) needs a machine with the CUDA toolkit.")
    elif missed:
        print(f"{missed} dump(s) MISSED the target of {TARGET:g}x")
        sys.exit(1)


if __name__ == "__main__":
    main()
