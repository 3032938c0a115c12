"""A rank dies of an illegal memory access and its mate waits in NCCL: rank 1's scatter kernel
(``scatter_ones``, Triton) writes through an index that is out of range, the CUDA error
surfaces at the next synchronize, and rank 1 exits with status 1. Rank 0 waits in the step's
all_reduce for a rank that is gone.

Reports: ROCm/triton#942 ("Triton kernel produces either illegal memory access, aperture
violation, or hangs"); vllm-project/vllm#18260 (one worker gone, the others hang in NCCL).
"""

import datetime
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

CASE = {
    "title": "NCCL: rank 1 exits on an illegal memory access, rank 0 waits in all_reduce",
    "source": "ROCm/triton#942; vllm-project/vllm#18260 (a crashed rank leaves its mates in NCCL)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 2,
    "culprit": ["rank 1"],
    "cause": r"exited|died|illegal|address|status 1",
    "hangs_after": 3,
    "needs": ["torch", "gpu"],
}


@triton.jit
def scatter_ones(out_ptr, idx_ptr):
    i = tl.program_id(0)
    j = tl.load(idx_ptr + i)
    tl.store(out_ptr + j, 1.0)


def main() -> None:
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    grad = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(grad)
    torch.cuda.synchronize()
    if rank == 1:
        out = torch.zeros(16, device="cuda")
        idx = torch.tensor([1 << 40], dtype=torch.int64, device="cuda")  # far outside out
        try:
            scatter_ones[(1,)](out, idx)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - torch.AcceleratorError in 2.11, a RuntimeError before: either
            print(f"rank 1: {exc}", file=sys.stderr)
            sys.exit(1)
    dist.all_reduce(grad)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
