"""A kernel of a CUDA graph faults after the replay returned: the error surfaces at the next call
that waits for the GPU (fakecuda plays the driver). The replay is PyTorch's own CUDAGraph.replay,
called on a stand-in: there is no GPU here, so it fails after the reporter noted it."""
import time

import fakecuda
from torch.cuda.graphs import CUDAGraph

import hangwatchd


class NoGpu:
    _tracker = None


for _ in range(5):
    hangwatchd.beat()
    time.sleep(0.05)
try:
    CUDAGraph.replay(NoGpu())  # line 20: the replay that launched the graph's kernels
except TypeError:
    pass
print(fakecuda.Tensor().item())  # line 23: where the error surfaces
