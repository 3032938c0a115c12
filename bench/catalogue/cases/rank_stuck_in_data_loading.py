"""A rank stuck in its data loading while the other waits in the collective: rank 1's
``next_batch`` reads its next shard from a FIFO (what a hung network mount looks like) that
nothing writes; rank 0 has its batch and waits in the step's ``all_reduce``.

Reports: dylanyunlon/Neuron_SP#73 ("Rank 0 advanced past the data fetch and hit the first
barrier, while ranks 1/2 were still blocked in next(self.data_iter)"); marin-community/marin#7039
("When one process's data loader stalls ... the processes that already have their batch enter
the on-device collective and block on the straggler").
"""

import datetime
import os
import tempfile

import torch
import torch.distributed as dist

CASE = {
    "title": "rank 1 blocked reading its data (FIFO); rank 0 in all_reduce",
    "source": "dylanyunlon/Neuron_SP#73; marin-community/marin#7039 (a rank stuck in its data loader)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["rank 1", "next_batch"],
    "cause": r"read|FIFO",
    "hangs_after": 3,
    "needs": ["torch"],
}


def next_batch(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(4096)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    with tempfile.TemporaryDirectory() as d:
        shard = os.path.join(d, f"rank{dist.get_rank()}-shard-0003")
        if dist.get_rank() == 1:
            os.mkfifo(shard)
            keep = os.open(shard, os.O_RDWR | os.O_NONBLOCK)  # the mount is there; its data never comes
        else:
            with open(shard, "wb") as f:
                f.write(b"\1" * 4096)
        next_batch(shard)
        dist.all_reduce(torch.ones(256))
        if dist.get_rank() == 1:
            os.close(keep)


if __name__ == "__main__":
    main()
