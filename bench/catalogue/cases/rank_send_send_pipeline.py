"""Pipeline-parallel send/send deadlock: stage 0 (rank 0) sends the activations of both
micro-batches before it receives any gradient; stage 1 (rank 1) receives micro-batch 0's
activation and then sends its gradient back before receiving micro-batch 1. Point-to-point
sends block until the peer posts the matching receive: rank 0 waits in ``send`` of
micro-batch 1, rank 1 waits in ``send`` of gradient 0, and neither will ever post a ``recv``.

Reports: pytorch/pytorch#172668 (pipeline schedule stuck "both ranks are waiting for the send to
finish so that they can receive. But neither of ranks are receiving"); NVIDIA/nccl#479 ("Will the
sequence of send and recv cause a deadlock?").
"""

import datetime

import torch
import torch.distributed as dist

CASE = {
    "title": "pipeline stages both in send (1F1B order broken); no rank posts a recv",
    "source": "pytorch/pytorch#172668; NVIDIA/nccl#479 (blocking send/send between two pipeline stages)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["rank 0", "rank 1"],
    "cause": r"none in recv|matching recv",
    "hangs_after": 3,
    "needs": ["torch"],
}

MICRO = 2


def stage0() -> None:
    for mb in range(MICRO):
        dist.send(torch.full((1024,), float(mb)), dst=1)  # all forwards first
    for _ in range(MICRO):
        dist.recv(torch.empty(1024), src=1)


def stage1() -> None:
    for _ in range(MICRO):
        act = torch.empty(1024)
        dist.recv(act, src=0)
        dist.send(act * 0.5, dst=0)  # gradient back before the next forward


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    stage0() if dist.get_rank() == 0 else stage1()


if __name__ == "__main__":
    main()
