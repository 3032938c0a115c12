"""A rank that sleeps before the collective: rank 1 waits for its checkpoint upload to "settle"
with ``time.sleep`` (an hour: a seconds/milliseconds mix-up) in ``wait_for_upload``, while rank
0 already waits in the step's ``all_reduce``.

Reports: instructlab/training#566 ("non-rank-0 processes were continuing on and waiting for
rank-0 forward, while rank 0 was saving artifacts. This was leading to collective timeouts");
NVIDIA/nccl#708 (a barrier halted while one process did its own long work).
"""

import datetime
import time

import torch
import torch.distributed as dist

CASE = {
    "title": "rank 1 sleeps before the all_reduce rank 0 waits in",
    "source": "instructlab/training#566; NVIDIA/nccl#708 (one rank busy elsewhere, the others in a collective)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["rank 1", "wait_for_upload"],
    "cause": r"sleep",
    "hangs_after": 3,
    "needs": ["torch"],
}

SETTLE_S = 3600.0  # meant as 3600 ms


def wait_for_upload() -> None:
    time.sleep(SETTLE_S)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    if dist.get_rank() == 1:
        wait_for_upload()
    dist.all_reduce(torch.ones(256))


if __name__ == "__main__":
    main()
