"""Another tenant of the GPU: matrix products on GPU 0 for ever (not watched; it keeps the device busy).

    python cause_busy_neighbour.py     (prints BUSY once its kernels run)
"""

import torch

a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
(a @ b).sum().item()
print("BUSY", flush=True)
while True:
    for _ in range(50):
        a @ b
    torch.cuda.synchronize()
