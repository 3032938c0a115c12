"""`hangwatchd symbolize --json DUMP` against `cuda-gdb --batch` on the same dump, fresh process against
fresh process, in the same run: what a person waits for when they type either.

    python bench/symbolize.py                 # every fixture dump
    python bench/symbolize.py DUMP [DUMP...]  # any dumps (raw or .xz/.gz/.zst), e.g. the H200's 112-126 MB ones
    python bench/symbolize.py --name symbolize_h200 DUMP...  # writes results/symbolize_h200.md (a device's table)

Each dump is written raw to disk first (decompressing is not what is measured). Two
labelled figures per dump, each side measured the same way:
- cold: the first run of each command on the dump, after the dump's pages are dropped
  from the page cache (posix_fadvise DONTNEED) and, for hangwatchd, with no bytecode
  cached for the package (what a first run after an install without .pyc costs);
- warm: the best of RUNS runs of each that follow (spread = slowest - best).
Target: hangwatchd at least TARGET times faster than cuda-gdb, warm against warm and cold
against cold. Without cuda-gdb (the CPU box) the baseline is `python -c pass`, a bare
fresh interpreter, in the same run, and the target is the fresh command's wall time.
The daemon's own path (a limited child forked from a warm fork server) is shown beside
it, labelled, never compared with a fresh cuda-gdb.

Issue 33: NCCL's hang dumps hold ~39,000 sections (each lane's registers, predicates and
backtrace) and took 3.5x the time and memory of the others. Without such a dump here, the
default run makes one from the cpp_hang fixture (tests/cudacore/section_heavy.py: 392 warps,
39,621 sections, padded to 123 MB like the real ones) and measures it against cpp_hang itself,
the same way in the same run: within HEAVY_RATIO of its time, under HEAVY_MB peak RSS.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hangwatchd.cudacore import sandbox  # noqa: E402 - after sys.path is set
from hangwatchd.cudacore.cudagdb import find_cuda_gdb  # noqa: E402 - after sys.path is set
from hangwatchd.cudacore.source import raw_path  # noqa: E402 - after sys.path is set
from tests.cudacore.section_heavy import section_heavy  # noqa: E402 - after sys.path is set

sys.path.insert(0, str(ROOT / "bench"))
from _figures import Figure, Spread, judged, report  # noqa: E402 - after sys.path is set

FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
RUNS = 5
TARGET = 2.0  # issue 21: hangwatchd symbolize at least twice as fast as cuda-gdb, fresh against fresh
CPU_S = 0.5  # without cuda-gdb: the whole fresh command's wall time, warm
HEAVY_RATIO = 2.0  # issue 33: a section-heavy dump within twice the time of the small one it was made from
HEAVY_MB = 25.0  # ... and under this peak RSS


def cuda_gdb_argv(tool: str, dump: Path) -> list[str]:
    """Exactly the command of issue 21: kernels, every warp, and the backtrace."""
    return [tool, "--batch", "-ex", f"target cudacore {dump}", "-ex", "info cuda kernels", "-ex", "info cuda warps", "-ex", "bt"]


def ours_argv(dump: Path) -> list[str]:
    return [sys.executable, "-m", "hangwatchd", "symbolize", "--json", str(dump)]


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_bytecode() -> None:
    for cache in (ROOT / "hangwatchd").rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)


# Each command is started by a bare interpreter that times it: a child's peak RSS as the
# kernel reports it is at least its parent's peak when it was started (exec keeps the larger),
# and this bench's own peak (the modules it imports, a dump it made) is no command's.
STARTER = """
import os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - start, usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one fresh process; exits the bench when it fails."""
    res = subprocess.run([sys.executable, "-c", STARTER, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    took, maxrss, code = res.stdout.split()[-3:]
    if int(code) != 0:
        raise SystemExit(f"{argv[0]} failed on {argv[-1]}: {res.stderr.decode(errors='replace')[-500:]}")
    return float(took), int(maxrss) / 1024


def cold_and_warm(argv: list[str], dump: Path, env: dict[str, str], ours: bool) -> tuple[float, Spread, float]:
    """(cold seconds, warm repeats, peak MB)."""
    drop_cache(dump)
    if ours:
        drop_bytecode()
    cold, peak = once(argv, env)
    warm = []
    for _ in range(RUNS):
        took, mb = once(argv, env)
        warm.append(took)
        peak = max(peak, mb)
    return cold, Spread(tuple(warm)), peak


def child(path: Path) -> Spread:
    """The daemon's way, for the record: the limited child forked from the warm fork server."""
    sandbox.symbolize(path)
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        sandbox.symbolize(path)
        times.append(time.perf_counter() - start)
    return Spread(tuple(times))


def heavy_figure(tmp: Path, env: dict[str, str], small: Spread, small_mb: float) -> Figure:
    """A dump shaped like NCCL's (40,000 sections) against the fixture it was made from."""
    small_dump = (tmp / "cpp_hang.nvcudmp").read_bytes()
    made = section_heavy(small_dump)
    raw = tmp / "nccl_like.nvcudmp"
    raw.write_bytes(made.data)
    made = dataclasses.replace(made, data=b"")  # this bench's memory is nobody's measure, but keep it small
    _cold, warm, mb = cold_and_warm(ours_argv(raw), raw, env, ours=False)
    ratio = warm.best / small.best
    noise = ratio * (warm.spread / warm.best + small.spread / small.best)
    ok, noisy = judged(ratio, noise, HEAVY_RATIO)
    return Figure(f"section-heavy, like NCCL's (made from cpp_hang: {made.warps} warps, {made.sections} sections, "
                  f"{raw.stat().st_size / 1e6:.1f} MB)",
                  f"fresh `hangwatchd symbolize --json`: warm {warm.text()}, {mb:.0f} MB peak RSS: {ratio:.2f}x the time",
                  f"cpp_hang ({int.from_bytes(small_dump[0x3C:0x3E], 'little')} sections) in the same run: warm {small.text()}, {small_mb:.0f} MB peak RSS",
                  f"within {HEAVY_RATIO:g}x the time, < {HEAVY_MB:g} MB", ok and mb < HEAVY_MB, noisy and mb < HEAVY_MB)


def dumps(args: list[str]) -> list[tuple[str, Path]]:
    if args:
        return [((Path(a).parent.name if Path(a).name.startswith("coredump.") else Path(a).name.split(".")[0])[:20], Path(a))
                for a in args]
    return [(xz.parent.name, xz) for xz in sorted(FIXTURES.glob("*/coredump.nvcudmp.xz"))]


def main() -> None:
    args = sys.argv[1:]
    name = "symbolize"
    if args[:1] == ["--name"] and len(args) > 1:  # e.g. symbolize_h200, for the device's own table
        name, args = args[1], args[2:]
    gdb = find_cuda_gdb()
    # Bytecode is written as it would be by an install (this box's PYTHONDONTWRITEBYTECODE would
    # make every "warm" run compile the package again).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    bare = cold_and_warm([sys.executable, "-c", "pass"], Path(sys.executable).resolve(), env, ours=False)[1]
    sandbox.start()
    figures = []
    measured: dict[str, tuple[Spread, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, src in dumps(args):
            raw = Path(tmp) / f"{label}.nvcudmp"
            with raw_path(src) as plain, open(plain, "rb") as fin, open(raw, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            what = f"{label} ({raw.stat().st_size / 1e6:.1f} MB)"
            cold, warm, mb = cold_and_warm(ours_argv(raw), raw, env, ours=True)
            measured[label] = (warm, mb)
            daemon = child(raw)
            figure = (f"fresh `hangwatchd symbolize --json`: warm {warm.text()}, cold {cold:.3f} s, {mb:.0f} MB peak RSS; "
                      f"(the daemon's forked child: {daemon.best:.3f} s)")
            if gdb:
                gcold, gwarm, _ = cold_and_warm(cuda_gdb_argv(gdb, raw), raw, env, ours=False)
                ratio = gwarm.best / warm.best
                # The ratio's noise: the warm spreads of both sides, relative.
                noise = ratio * (warm.spread / warm.best + gwarm.spread / gwarm.best)
                ok, noisy = judged(ratio, noise, TARGET, higher_is_better=True)
                cok = gcold / cold >= TARGET
                figures.append(Figure(what + ", warm against warm", figure,
                                      f"fresh cuda-gdb warm {gwarm.text()}: {ratio:.2f}x ours", f">= {TARGET:g}x faster",
                                      ok, noisy))
                figures.append(Figure(what + ", cold against cold", f"fresh `hangwatchd symbolize --json` cold {cold:.3f} s",
                                      f"fresh cuda-gdb cold {gcold:.3f} s: {gcold / cold:.2f}x ours", f">= {TARGET:g}x faster",
                                      cok))
            else:
                ok, noisy = judged(warm.best, warm.spread, CPU_S)
                figures.append(Figure(what, figure, f"cuda-gdb not here; a bare fresh `python -c pass`: {bare.text()}",
                                      f"fresh `symbolize` within {CPU_S:g} s (warm)", ok, noisy))
        if not args:
            figures.append(heavy_figure(Path(tmp), env, *measured["cpp_hang"]))
    sandbox.stop()
    ok = report(name, figures, note=f"best of {RUNS} warm runs after one cold run, each side the same way",
                command="python bench/symbolize.py" + (f" --name {name}" if name != "symbolize" else "") + (" DUMP..." if args else ""))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
