"""A Triton kernel that spins forever after a training loop that beat: the host waits
in cuStreamSynchronize under Tensor.__repr__ (as in the triton_hang fixture)."""

import time

import torch
import triton
import triton.language as tl

import hangwatchd


@triton.jit
def conditional_hang_kernel(x_ptr, flag, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    if flag == 1:
        x = x + 1
        tl.store(x_ptr + offs, x, mask=mask)
    else:
        while flag == 0:
            x = x + 1
            tl.store(x_ptr + offs, x, mask=mask)  # SPINS HERE


def step(x, flag):
    conditional_hang_kernel[(1,)](x, flag=flag, n_elements=x.numel(), BLOCK_SIZE=16)


def main():
    x = torch.ones(16, dtype=torch.float32, device="cuda")
    for _ in range(20):
        step(x, 1)
        torch.cuda.synchronize()
        hangwatchd.beat()
        time.sleep(0.05)
    print(f"STALL {time.time()}", flush=True)
    step(x, 0)
    print("After flag=0:", x, flush=True)


if __name__ == "__main__":
    main()
