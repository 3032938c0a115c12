"""How long `hangwatchd symbolize` takes on each real dump, and its peak memory,
against cuda-gdb on the same dump in the same run where cuda-gdb is installed.

    python bench/symbolize.py            # every fixture
Prints one row per dump: our seconds and MB, cuda-gdb's seconds, and the ratio.
"""

from __future__ import annotations

import lzma
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd.cudacore.cudagdb import cuda_gdb_argv, find_cuda_gdb  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
RUNS = 3


def timed(argv: list[str]) -> tuple[float, float]:
    """Best wall time of RUNS runs, and the peak RSS (MB) of the child."""
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


def main() -> None:
    gdb = find_cuda_gdb()
    print(f"{'dump':<12} {'MB':>6} {'ours s':>7} {'ours MB':>8} {'cuda-gdb s':>10} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for xz in sorted(FIXTURES.glob("*/coredump.nvcudmp.xz")):
            raw = Path(tmp) / f"{xz.parent.name}.nvcudmp"
            raw.write_bytes(lzma.decompress(xz.read_bytes()))
            ours, mem = timed([sys.executable, "-m", "hangwatchd", "symbolize", "--json", str(raw)])
            theirs = timed(cuda_gdb_argv(gdb, str(raw)))[0] if gdb else None
            ratio = f"{theirs / ours:5.2f}x" if theirs else "n/a"
            print(f"{xz.parent.name:<12} {raw.stat().st_size / 1e6:6.1f} {ours:7.2f} {mem:8.0f} "
                  f"{(f'{theirs:10.2f}' if theirs else '       n/a')} {ratio:>6}")
    if not gdb:
        print("cuda-gdb is not installed here: the ratio (cuda-gdb time / ours, higher is better for us) needs a GPU machine.")


if __name__ == "__main__":
    main()
