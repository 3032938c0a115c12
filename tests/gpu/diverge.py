"""Two ranks that diverge. Run with torchrun --nproc-per-node 2.

DIVERGE_MODE=skip (default): rank 1 skips an all_gather that rank 0 enters; rank 0 then waits
for the GPU forever, rank 1 waits somewhere else.
DIVERGE_MODE=sizes: both enter all_gather_into_tensor, rank 1 with twice the elements; then
both stop beating (whether or not NCCL hangs on it), so the flight recorders are taken.
"""

import os
import time

import torch
import torch.distributed as dist

import hangwatchd


def train_step(x):
    dist.all_reduce(x)
    torch.cuda.synchronize()


def gather_features(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)     # rank 1 never comes
    torch.cuda.synchronize()


def gather_mismatched(rank):
    x = torch.ones(1024 * (rank + 1), device="cuda")
    out = torch.empty(2 * 1024 * (rank + 1), device="cuda")
    dist.all_gather_into_tensor(out, x)   # rank 1 sends twice what rank 0 expects
    torch.cuda.synchronize()
    while True:
        time.sleep(1)


def evaluate_only_on_rank_1():
    while True:                 # the branch rank 1 took instead
        time.sleep(1)


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    x = torch.ones(1024, device="cuda")
    for _ in range(20):
        train_step(x)
        hangwatchd.beat()
        time.sleep(0.05)
    print(f"rank {rank} diverging at {time.time()}", flush=True)
    if os.environ.get("DIVERGE_MODE") == "sizes":
        gather_mismatched(rank)
    if rank == 1:
        evaluate_only_on_rank_1()
    gather_features(x)


if __name__ == "__main__":
    main()
