"""Ranks disagree on a broadcast's source: the weights are to be broadcast from rank 0, but rank
1 computes ``src`` from a stale config (its own rank), so each rank believes it is the source
of the same broadcast. Both wait in ``broadcast`` forever.

Reports: NVIDIA/Megatron-LM#796 ("Fix incorrect src argument in broadcast_params"); NVIDIA/nccl#147
("the first call to a collective (Broadcast) has mismatch parameters between the ranks").
"""

import datetime

import torch
import torch.distributed as dist

CASE = {
    "title": "broadcast with a different src on each rank",
    "source": "NVIDIA/Megatron-LM#796; NVIDIA/nccl#147 (broadcast parameters differ between ranks)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["rank 1", "broadcast_weights"],
    "cause": r"src|source|root|disagree|mismatch",
    "hangs_after": 3,
    "needs": ["torch"],
}


def broadcast_weights(weights: torch.Tensor, src: int) -> None:
    dist.broadcast(weights, src=src)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    src = 0 if rank == 0 else rank  # rank 1's config still says "broadcast from yourself"
    broadcast_weights(torch.zeros(1024), src)


if __name__ == "__main__":
    main()
