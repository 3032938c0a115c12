"""A process that never imports hangwatchd and hangs on the GPU: a Triton kernel spins forever
while the host waits for it in cuStreamSynchronize. Only discovery can find it."""

import time

import torch
import triton
import triton.language as tl


@triton.jit
def spin_kernel(x_ptr, flag, n_elements, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0)
    while flag == 0:
        x = x + 1
        tl.store(x_ptr + offs, x, mask=mask)  # SPINS HERE


def main() -> None:
    x = torch.ones(16, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    print(f"STALL {time.time()}", flush=True)
    spin_kernel[(1,)](x, flag=0, n_elements=x.numel(), BLOCK_SIZE=16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
