"""One rank of a two-rank job whose ranks live under different daemons ("nodes").

Started once per rank with RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT set (env://).
Rank 0 enters an all_gather rank 1 never joins and stops beating there; rank 1 took
another branch and keeps beating in it: its own daemon sees nothing wrong.
"""

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


def evaluate_only_on_rank_1():
    while True:                 # the branch rank 1 took instead: it still beats
        hangwatchd.beat()
        time.sleep(0.5)


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
    if rank == 1:
        evaluate_only_on_rank_1()
    gather_features(x)


if __name__ == "__main__":
    main()
