"""How long `hangwatchd symbolize` takes on each real dump, and its peak memory,
against cuda-gdb on the same dump in the same run where cuda-gdb is installed.

    python bench/symbolize.py            # every fixture
One figure per dump: our seconds and MB against the targets (2 s, 200 MB), cuda-gdb's seconds as the baseline.
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

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, report  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
RUNS = 3
TARGET_S, TARGET_MB = 2.0, 200.0


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
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for xz in sorted(FIXTURES.glob("*/coredump.nvcudmp.xz")):
            raw = Path(tmp) / f"{xz.parent.name}.nvcudmp"
            raw.write_bytes(lzma.decompress(xz.read_bytes()))
            ours, mem = timed([sys.executable, "-m", "hangwatchd", "symbolize", "--json", str(raw)])
            theirs = timed(cuda_gdb_argv(gdb, str(raw)))[0] if gdb else None
            baseline = f"cuda-gdb {theirs:.2f} s ({theirs / ours:.2f}x ours)" if theirs else "cuda-gdb not installed here"
            figures.append(Figure(f"{xz.parent.name} ({raw.stat().st_size / 1e6:.1f} MB)", f"{ours:.2f} s, {mem:.0f} MB peak RSS",
                                  baseline, f"within {TARGET_S:g} s and {TARGET_MB:g} MB", ours <= TARGET_S and mem <= TARGET_MB))
    report("symbolize", figures, note="best of 3, the child's peak RSS (the mapped dump's pages count)")

if __name__ == "__main__":
    main()
