"""Healthy look-alike: a barrier where one rank arrives 10 s late. Rank 1 loads its shard of
the data for 10 s (CPU work) while rank 0 waits in ``barrier``; then both train (a matmul, an
all-reduce, again). The job's stack timeout is 15 s, longer than the wait: a wait that the user
said is normal must not be a hang.

Report: sgl-project/sglang#39128 ("Make model loading barrier timeout configurable": some TP
ranks take far longer to load, the others wait in the barrier).
"""

import datetime
import time

import torch
import torch.distributed as dist

CASE = {
    "title": "barrier where the other rank arrives after 10 s (stack timeout 15 s)",
    "source": "sgl-project/sglang#39128 (ranks that load slower keep the others in a barrier)",
    "healthy": True,
    "watch": {"stack_timeout": 15},
    "ranks": 2,
    "culprit": [],
    "cause": r"",
    "hangs_after": 3,
    "observe": 35,
    "needs": ["torch"],
}


def load_shard(seconds: float) -> int:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += sum(range(10_000))
    return n


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    if dist.get_rank() == 1:
        load_shard(10.0)
    dist.barrier()
    w = torch.randn(256, 256)
    end = time.monotonic() + 60.0
    while time.monotonic() < end:  # then train: compute, then all-reduce, with no idle gap
        grad = w @ w
        dist.all_reduce(grad)


if __name__ == "__main__":
    main()
