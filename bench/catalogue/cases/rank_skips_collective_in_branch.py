"""One rank skips a collective in a branch: ``if rank == 0: all_reduce(loss)`` to log the mean
loss on rank 0 only; rank 1 goes on to the end-of-epoch ``barrier`` in ``finish_epoch``. Rank 0
waits in an all_reduce that rank 1 never entered; rank 1 waits in a barrier rank 0 never
reaches.

Reports: alan-turing-institute/autocast#386 ("save_checkpoint() is a collective operation ...
it was called inside an `if trainer.is_global_zero:` block, so only rank 0 entered that
barrier"); pytorch/pytorch#138322 (`if rank != 3: barrier()`).
"""

import datetime

import torch
import torch.distributed as dist

CASE = {
    "title": "rank 1 skips a collective in a rank-0-only branch",
    "source": "alan-turing-institute/autocast#386; pytorch/pytorch#138322 (a collective under if rank == 0)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["rank 1"],
    "cause": r"rank 1 .*never (entered|reached|joined)|skip",
    "hangs_after": 3,
    "needs": ["torch"],
}


def log_mean_loss(loss: torch.Tensor) -> None:
    dist.all_reduce(loss)


def finish_epoch() -> None:
    dist.barrier()


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    loss = torch.tensor([0.5])
    if dist.get_rank() == 0:
        log_mean_loss(loss)
    finish_epoch()


if __name__ == "__main__":
    main()
