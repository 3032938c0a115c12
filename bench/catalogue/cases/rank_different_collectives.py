"""Two ranks in different collectives at different call sites: rank 0 all-reduces gradients in
``train_step``; rank 1 decided it is time to evaluate (its step counter was off by one after a
resume) and waits in ``evaluate``'s ``barrier``. Each waits in a collective the other never
entered.

Reports: pytorch/pytorch#54059 ("Using torch.distributed.barrier() makes the whole code hang":
validation on one rank, a barrier for the others); huggingface/transformers#17478 ("Training
hangs in the end while calling dist.barrier()", with "Detected mismatch between collectives").
"""

import datetime

import torch
import torch.distributed as dist

CASE = {
    "title": "rank 0 in all_reduce (train_step), rank 1 in barrier (evaluate)",
    "source": "pytorch/pytorch#54059; huggingface/transformers#17478 (mismatched collectives)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["rank 1", "evaluate"],
    "cause": r"never (entered|reached|joined)|different collective|mismatch",
    "hangs_after": 3,
    "needs": ["torch"],
}


def train_step(step: int) -> None:
    dist.all_reduce(torch.ones(256))


def evaluate() -> None:
    dist.barrier()


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    for step in range(3):
        train_step(step)
    resumed_step = 3 + (1 if rank == 1 else 0)  # rank 1 read a stale step from its checkpoint
    if resumed_step % 4 == 0:
        evaluate()
    else:
        train_step(resumed_step)


if __name__ == "__main__":
    main()
