"""A rank stuck on a Python lock before the collective: on rank 1, the background thread
ckpt-writer took the checkpoint lock and died on a full disk (OSError) without releasing it;
rank 1's main thread waits for that lock in ``snapshot_weights`` before the step's
``all_reduce``, which rank 0 already waits in. The chain: rank 0 → rank 1's main thread → a
lock → a thread that is gone.

Reports: dylanyunlon/Neuron_SP#73 ("Training hangs at step 0: rank 1/2 never reach forward": the
ranks were blocked earlier, rank 0 waits in the barrier); Maluuba/nlg-eval#25 (an exception in
the thread that held the lock).
"""

import datetime
import threading

import torch
import torch.distributed as dist

CASE = {
    "title": "rank 1 waits on a lock whose holder thread died; rank 0 in all_reduce",
    "source": "dylanyunlon/Neuron_SP#73; Maluuba/nlg-eval#25 (a rank blocked before the collective)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["ckpt-writer", "write_checkpoint"],
    "cause": r"exited|died|raised|exception|is gone|never releas",
    "hangs_after": 3,
    "needs": ["torch"],
}

ckpt_lock = threading.Lock()


def write_checkpoint() -> None:
    ckpt_lock.acquire()
    raise OSError(28, "No space left on device")  # the release below never runs
    ckpt_lock.release()


def snapshot_weights() -> None:
    with ckpt_lock:
        pass


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    if dist.get_rank() == 1:
        t = threading.Thread(target=write_checkpoint, name="ckpt-writer")
        t.start()
        t.join()
        snapshot_weights()
    dist.all_reduce(torch.ones(256))


if __name__ == "__main__":
    main()
