"""A training loop on the GPU fed by a torch DataLoader with 2 workers; sample 5 lives in
shard-0042, a FIFO nobody writes, so DataLoader worker 1 blocks for ever in read_shard.

    python cause_dataloader.py SHARD_DIR     (prints STALL <time> when it asks for sample 5)
"""

import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import hangwatchd


def read_shard(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(4096)


class Shards(Dataset):
    def __init__(self, root: str) -> None:
        self.root = root

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        name = "shard-0042" if i == 5 else f"shard-{i % 3:04d}"
        data = read_shard(os.path.join(self.root, name))
        return torch.frombuffer(bytearray(data.ljust(16, b"\0")[:16]), dtype=torch.uint8).float()


def train(root: str) -> None:
    model = torch.nn.Linear(16, 16).cuda()
    loader = DataLoader(Shards(root), batch_size=1, num_workers=2, pin_memory=True)
    for step, batch in enumerate(loader):
        model(batch.cuda()).sum().item()
        hangwatchd.beat()
        if step == 4:
            print(f"STALL {time.time()}", flush=True)


if __name__ == "__main__":
    root = sys.argv[1]
    os.makedirs(root, exist_ok=True)
    for i in range(3):
        with open(os.path.join(root, f"shard-{i:04d}"), "wb") as f:
            f.write(bytes(range(16)) * 4)
    fifo = os.path.join(root, "shard-0042")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer that never writes: the reader's read blocks
    for _ in range(10):  # a few beats before the loader starts, so the heartbeat is armed
        hangwatchd.beat()
        time.sleep(0.05)
    train(root)
