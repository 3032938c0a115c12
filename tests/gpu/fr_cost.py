"""Where a flight-recorder dump spends its time, in-process, against the number of entries.

    python3 tests/gpu/fr_cost.py OUTDIR

One rank with a one-rank NCCL group (its own FileStore) does all_reduces in rounds; after
each round the trace is dumped through PyTorch's own call (the one its pipe thread makes:
``_dump_nccl_trace(collectives, stack traces, only active)``) with and without stack
traces, each timed. The first dump (PyTorch imports torch._inductor on it) is timed apart,
and the slowest dump with stack traces is profiled (cProfile: the Python it calls back
into). Then the hang, as run_fast.py makes it: a Triton kernel spinning and the main thread
in torch.cuda.synchronize behind it, while a helper thread times, at each of 10 and 400
entries (two runs of this script), the same call made from that thread and a dump through
PyTorch's pipe (written, then the trace file timed). Writes OUTDIR/fr_cost*.json and
OUTDIR/profile.txt; prints the table.

    python3 tests/gpu/fr_cost.py OUTDIR [--hang ENTRIES]
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist


def hang(out: Path, entries: int, warm_while_running: float = 0.0) -> int:
    """ENTRIES all_reduces, a first dump (the import), then the spinning kernel; a helper thread times dumps.

    warm_while_running > 0: instead, steps as fast_rank.py takes them for that many seconds, the
    first dump asked through the pipe 1 s in (as the daemon's warm-up does), then the hang."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from triton_hang import conditional_hang_kernel as spin

    pipe_prefix, trace_prefix = str(out / "pipe_"), str(out / "trace_")
    os.environ.update(TORCH_NCCL_DEBUG_INFO_PIPE_FILE=pipe_prefix, TORCH_FR_DUMP_TEMP_FILE=trace_prefix,
                      TORCH_NCCL_DEBUG_INFO_TEMP_FILE=trace_prefix)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(tempfile.mktemp(prefix="fr-cost-"), 1), rank=0, world_size=1)
    dump = torch._C._distributed_c10d._dump_nccl_trace
    y = torch.ones(1 << 16, device="cuda")
    x = torch.ones(16, device="cuda")
    result: dict[str, object] = {"entries": entries, "warm_while_running": warm_while_running}
    spin[(1,)](x, flag=1, n_elements=16, BLOCK_SIZE=16)
    torch.cuda.synchronize()

    def via_pipe() -> float:
        trace = Path(trace_prefix + "0")
        before = trace.stat().st_mtime_ns if trace.exists() else 0
        started = time.perf_counter()
        fd = os.open(pipe_prefix + "0.pipe", os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"1")
        os.close(fd)
        while time.perf_counter() - started < 60:
            if trace.exists() and trace.stat().st_mtime_ns != before and trace.stat().st_size > 0:
                time.sleep(0.05)  # written and closed
                return time.perf_counter() - started
            time.sleep(0.01)
        return float("nan")

    if warm_while_running:
        def warm() -> None:
            time.sleep(1)
            result["warmup_pipe_s"] = round(via_pipe(), 3)
            result["inductor_after_warmup"] = "torch._inductor" in sys.modules
        threading.Thread(target=warm, daemon=True).start()
        end = time.monotonic() + warm_while_running
        steps = 0
        while time.monotonic() < end:
            sum(i * i for i in range(20_000))
            spin[(1,)](x, flag=1, n_elements=16, BLOCK_SIZE=16)
            dist.all_reduce(y)
            torch.cuda.synchronize()
            steps += 1
            time.sleep(0.05)
        result.update(entries=steps, inductor_at_hang="torch._inductor" in sys.modules)
    else:
        for _ in range(entries):
            dist.all_reduce(y)
        torch.cuda.synchronize()
        dump(True, True, False)  # the first dump's import, out of the way

    def helper() -> None:
        time.sleep(2)  # the main thread is in synchronize behind the spinning kernel
        for k in range(2):
            result[f"pipe_s_{k}"] = round(via_pipe(), 3)
            started = time.perf_counter()
            dump(True, True, False)
            result[f"call_from_thread_s_{k}"] = round(time.perf_counter() - started, 3)
            print(result, flush=True)
        (out / f"fr_cost_hang_{entries}_{warm_while_running:g}.json").write_text(json.dumps(result, indent=1))
        os._exit(0)

    threading.Thread(target=helper, daemon=True).start()
    spin[(1,)](x, flag=0, n_elements=16, BLOCK_SIZE=16)
    torch.cuda.synchronize()  # never returns
    return 1


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if "--hang" in sys.argv:
        warm = float(sys.argv[sys.argv.index("--warm-while-running") + 1]) if "--warm-while-running" in sys.argv else 0.0
        return hang(out, int(sys.argv[sys.argv.index("--hang") + 1]), warm)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(tempfile.mktemp(prefix="fr-cost-"), 1), rank=0, world_size=1)
    dump = torch._C._distributed_c10d._dump_nccl_trace
    y = torch.ones(1 << 16, device="cuda")

    def steps(n: int) -> None:
        for _ in range(n):
            dist.all_reduce(y)
        torch.cuda.synchronize()

    def timed(stacks: bool) -> float:
        started = time.perf_counter()
        dump(True, stacks, False)
        return time.perf_counter() - started

    steps(10)
    first = {"entries": 10, "inductor_before": "torch._inductor" in sys.modules}
    first["first_dump_s"] = round(timed(True), 3)
    first["inductor_after"] = "torch._inductor" in sys.modules
    print("first dump", first, flush=True)
    rows, done, worst = [], 10, None
    for total in (10, 50, 100, 200, 400, 1000):
        steps(total - done)
        done = total
        row = {"entries": total, "stacks_s": round(timed(True), 4), "no_stacks_s": round(timed(False), 4),
               "stacks_again_s": round(timed(True), 4)}
        rows.append(row)
        print(row, flush=True)
        worst = total
    prof = cProfile.Profile()
    prof.enable()
    took = timed(True)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    (out / "profile.txt").write_text(f"one dump of {worst} entries with stack traces: {took:.3f} s\n" + text.getvalue())
    print(text.getvalue()[:6000], flush=True)
    (out / "fr_cost.json").write_text(json.dumps({"first": first, "rows": rows, "torch": torch.__version__}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
