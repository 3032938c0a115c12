"""Healthy look-alike: long collectives that complete. Two ranks all-reduce a 64 Mi-float
tensor (256 MiB) over gloo, again and again for 40 s; each call takes seconds, and the stack of
both ranks sits in ``all_reduce`` nearly all the time. The data is moving.

Report: NVIDIA/nccl#849 ("Ranks 4, 5, 6, 7 failed to pass monitoredBarrier": a long collective
phase judged hung by a timeout).
"""

import datetime
import time

import torch
import torch.distributed as dist

CASE = {
    "title": "long all_reduce of a big tensor that completes (2 ranks)",
    "source": "NVIDIA/nccl#849 (a long collective phase mistaken for a hang)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": [],
    "cause": r"",
    "hangs_after": 3,
    "observe": 30,
    "needs": ["torch"],
}

RUN_S = 40.0


def sync_gradients(grad: torch.Tensor) -> None:
    dist.all_reduce(grad)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    grad = torch.ones(64 << 20)
    end = time.monotonic() + RUN_S
    while time.monotonic() < end:
        sync_gradients(grad)
        grad.fill_(1.0)


if __name__ == "__main__":
    main()
