"""One rank for run_fast.py: beats, then hangs in a spinning Triton kernel with the host in
cuStreamSynchronize behind it. Started by `hangwatchd run` (the coredump and flight-recorder
variables set before CUDA starts).

    RANK=r python3 tests/gpu/fast_rank.py [--fr]

--inductor: import torch._inductor first, as a torch.compile user has it.
--many-kernels: load many modules first (a big GPU dump, as a real training process makes).
--hang sleep: stop beating in time.sleep, the GPU idle, instead of the spinning kernel.
--run-seconds S: take steps for S seconds before the hang (default 1), then print
      "STEPS {json}": the steps' median and slowest time and the rank's RSS, what the daemon's
      flight-recorder warm-up costs a rank in its first seconds.
--fr: a one-rank NCCL process group (its own FileStore) with a few all_reduces first, so that
      the flight recorder has entries and its pipe (named for rank 0) is there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

import hangwatchd  # noqa: E402

# The triton_hang scenario's kernel, spinning while flag == 0 (this script's directory is on sys.path).
from triton_hang import conditional_hang_kernel as spin_kernel  # noqa: E402


def barrier() -> None:
    """Every rank of the run ready (torch, CUDA, the kernel compiled) before any starts its last
    beats: they hang together, as a job's ranks do. $FAST_BARRIER_DIR, $FAST_RANKS from run_fast.py."""
    where, ranks = os.environ.get("FAST_BARRIER_DIR"), int(os.environ.get("FAST_RANKS", "1"))
    if not where:
        return
    open(os.path.join(where, f"ready.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 180
    while len([n for n in os.listdir(where) if n.startswith("ready.")]) < ranks and time.monotonic() < deadline:
        time.sleep(0.01)


def many_kernels() -> None:
    """cuBLAS, cuDNN, cuFFT and many of PyTorch's own kernels, in three dtypes: each loads its module."""
    a = torch.randn(256, 256, device="cuda")
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        b = a.to(dt)
        for op in (lambda t: t @ t, lambda t: t.softmax(-1), lambda t: torch.nn.functional.layer_norm(t, t.shape[-1:]),
                   lambda t: torch.sort(t), lambda t: torch.topk(t, 5), lambda t: t.cumsum(0), lambda t: t.exp(),
                   lambda t: torch.nn.functional.gelu(t), lambda t: t.sum(0), lambda t: t.max(1), lambda t: t[t > 0],
                   lambda t: torch.nn.functional.dropout(t, 0.1), lambda t: t.argsort(1)):
            op(b)
    conv = torch.nn.Conv2d(3, 8, 3).cuda()
    conv(torch.randn(2, 3, 32, 32, device="cuda"))
    torch.fft.fft(a)
    torch.linalg.qr(a[:64, :64])
    torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fr", action="store_true")
    p.add_argument("--hang", choices=("spin", "sleep"), default="spin",
                   help="sleep: the host sleeps and the GPU is idle (run_diag.py's flight-recorder baseline)")
    p.add_argument("--inductor", action="store_true",
                   help="import torch._inductor first, as a torch.compile user has it (PyTorch's flight recorder "
                        "imports it the first time it dumps)")
    p.add_argument("--many-kernels", action="store_true",
                   help="run many kinds of kernel first, so the GPU dump holds many modules (a big dump)")
    p.add_argument("--run-seconds", type=float, default=1.0, help="seconds of steps before the hang")
    a = p.parse_args()
    if a.inductor:
        importlib.import_module("torch._inductor")
    torch.cuda.set_device(0)  # every rank on the one GPU lent
    x = torch.ones(16, dtype=torch.float32, device="cuda")
    reduce = None
    if a.fr:
        import torch.distributed as dist

        store = dist.FileStore(tempfile.mktemp(prefix="fast-rank-store-"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        y = torch.ones(1 << 16, device="cuda")

        def reduce() -> None:
            dist.all_reduce(y)
    if a.many_kernels:
        many_kernels()
    spin_kernel[(1,)](x, flag=1, n_elements=x.numel(), BLOCK_SIZE=16)  # compiled before the barrier
    torch.cuda.synchronize()
    barrier()
    took = []
    end = time.monotonic() + a.run_seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        sum(i * i for i in range(20_000))  # a step's Python work, which needs the GIL
        spin_kernel[(1,)](x, flag=1, n_elements=x.numel(), BLOCK_SIZE=16)
        if reduce:
            reduce()
        torch.cuda.synchronize()
        took.append(time.perf_counter() - started)
        hangwatchd.beat()
        time.sleep(0.05)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    took.sort()
    print("STEPS " + json.dumps({"steps": len(took), "median_ms": round(took[len(took) // 2] * 1e3, 2),
                                 "slowest_ms": round(took[-1] * 1e3, 2), "rss_mb": rss // 1024}), flush=True)
    print(f"STALL {time.time()}", flush=True)
    if a.hang == "sleep":
        time.sleep(3600)
    spin_kernel[(1,)](x, flag=0, n_elements=x.numel(), BLOCK_SIZE=16)
    torch.cuda.synchronize()  # never returns: the host waits for the spinning kernel
    return 0


if __name__ == "__main__":
    sys.exit(main())
