"""A GPU kernel that spins forever: ``wait_for_flag`` (a Triton kernel) polls a flag in global
memory that the producer kernel was meant to set, but the producer was launched on a stream
behind it and never runs while it spins. The host waits in ``torch.cuda.synchronize()``, the
GPU is 100 % busy with one spinning kernel.

Reports: triton-lang/triton#11037 ("tl.atomic_add inside a while loop hangs ...
torch.cuda.synchronize() blocks forever"); 1bit-MONSTER/1bit-MONSTER#405 ("spin-wait loop has
no timeout — risk of GPU hang").
"""

import torch
import triton
import triton.language as tl

CASE = {
    "title": "Triton kernel spinning on a flag that is never set",
    "source": "triton-lang/triton#11037; 1bit-MONSTER/1bit-MONSTER#405 (a kernel spin-waits forever)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["wait_for_flag"],
    "cause": r"spin|still running|never (set|written)",
    "hangs_after": 3,
    "needs": ["gpu"],
}


@triton.jit
def wait_for_flag(flag_ptr, out_ptr):
    v = tl.load(flag_ptr, volatile=True)
    while v == 0:
        v = tl.load(flag_ptr, volatile=True)
    tl.store(out_ptr, v)


@triton.jit
def set_flag(flag_ptr):
    tl.store(flag_ptr, 1)


def main() -> None:
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    wait_for_flag[(1,)](flag, out)
    set_flag[(1,)](flag)  # same stream: queued behind the kernel that waits for it
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
