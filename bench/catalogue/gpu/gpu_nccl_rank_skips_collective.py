"""A rank skips an NCCL collective in a branch: only rank 0 all-reduces the loss to log it
(``log_mean_loss``), then waits for it; rank 1 skips it and waits in the rendezvous store for
rank 0's "metrics published" key, which rank 0 sets after its all-reduce. Rank 0's NCCL kernel
waits for rank 1 on the GPU; rank 1 waits for rank 0 on the host.

Reports: alan-turing-institute/autocast#386 (a collective called inside
``if trainer.is_global_zero:``: only rank 0 entered it); pytorch/pytorch#138322.
"""

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

CASE = {
    "title": "NCCL: rank 1 skips the all_reduce rank 0 waits in",
    "source": "alan-turing-institute/autocast#386; pytorch/pytorch#138322 (a collective under if rank == 0)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["rank 1"],
    "cause": r"rank 1 .*never (entered|reached|joined)|skip",
    "hangs_after": 3,
    "needs": ["torch", "gpu"],
}


def log_mean_loss(loss: torch.Tensor) -> None:
    dist.all_reduce(loss)
    torch.cuda.synchronize()


def main() -> None:
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    store = distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(hours=2))
    dist.all_reduce(torch.ones(1, device="cuda"))  # the communicator is up on both ranks
    torch.cuda.synchronize()
    loss = torch.tensor([0.25], device="cuda")
    if rank == 0:
        log_mean_loss(loss)
        store.set("metrics_published", "1")
    else:
        store.get("metrics_published")


if __name__ == "__main__":
    main()
