"""One rank runs out of data and exits with status 0 while the other waits in the next
collective: rank 1's shard has 3 batches, rank 0's has 6 (uneven split, as with a
``ceil(total / world)`` partition); rank 1 finishes its loop and exits normally, rank 0 waits
in ``all_reduce`` for step 4 forever. Both beat once per step.

(With NCCL this hangs as it is. Gloo would notice the closed sockets and raise, so rank 1, as
ranks often do, has forked a helper, here a log shipper, that still holds the process's
sockets: the peer never sees them close, as NCCL's peers never do.)

Reports: pytorch/pytorch#33148 ("Support uneven DDP inputs": "DDP instances processing more
input batches will hang, as the peer with least input batch will not join those additional
allreduce operations"); k2-fsa/snowfall#152 ("the node with most utterances will hang in the end").
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

import hangwatchd

CASE = {
    "title": "rank 1 exits early (status 0, uneven data); rank 0 waits in all_reduce",
    "source": "pytorch/pytorch#33148; k2-fsa/snowfall#152 (uneven inputs: the longer rank hangs)",
    "healthy": False,
    "watch": {"heartbeat_timeout": 3},
    "ranks": 2,
    "culprit": ["rank 1"],
    "cause": r"exited|rank 1 .*never (joined|entered|reached)",
    "hangs_after": 3,
    "needs": ["torch"],
}


def start_log_shipper() -> None:
    if os.fork() == 0:
        time.sleep(3600)  # inherits the rank's sockets
        os._exit(0)


def train(batches: int) -> None:
    grad = torch.ones(1024)
    for _ in range(batches):
        dist.all_reduce(grad)
        hangwatchd.beat()
        time.sleep(0.1)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    if rank == 1:
        start_log_shipper()
    train(batches=6 if rank == 0 else 3)


if __name__ == "__main__":
    main()
