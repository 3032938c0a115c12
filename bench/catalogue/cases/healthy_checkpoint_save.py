"""Healthy look-alike: a long checkpoint save. ``save_checkpoint`` serialises and writes shards
for 40 s, CPU-bound; its stack is the same two or three frames the whole time (the work is in
C, inside pickle and write), but it is making progress.

Report: pytorch/torchtitan#3065 ("DCP load hang forever without error at scale": telling a
long checkpoint phase from a hang needs more than the stack).
"""

import os
import pickle
import tempfile
import time

CASE = {
    "title": "checkpoint save: CPU-bound writing for 40 s, same stack",
    "source": "pytorch/torchtitan#3065 (a long checkpoint phase looks like a hang)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}

SAVE_S = 40.0


def save_checkpoint(directory: str) -> int:
    shard = [float(i) for i in range(200_000)]
    written = 0
    end = time.monotonic() + SAVE_S
    with open(os.path.join(directory, "model.ckpt"), "wb") as f:
        while time.monotonic() < end:
            written += f.write(pickle.dumps(shard, protocol=4))
            f.seek(0)  # keep the file small: the point is the work, not the disk
    return written


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(d)
