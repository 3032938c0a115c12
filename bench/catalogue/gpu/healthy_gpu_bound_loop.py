"""Healthy look-alike: a GPU-bound training loop. Each step runs four matmuls and waits for them
in ``torch.cuda.synchronize()`` (about 10 ms a step): nearly every stack sample lands in the
same sync, on the same line, for 60 s. Nothing is stuck: the GPU's work completes step after
step, and the loop's variables (the step, the activations) are new at every sample.

Report: hangwatchd#27, this project's own issue (on an H200, a healthy loop of 4 matmuls and a sync per 10.8 ms
step, found by discovery, was declared hung in 2 runs of 2: "host blocked in cuStreamSynchronize").
"""

import time

import torch

CASE = {
    "title": "GPU-bound loop whose every sample lands in one CUDA sync",
    "source": "hangwatchd#27 (a busy GPU loop read as stuck in cuStreamSynchronize)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 40,
    "needs": ["gpu"],
}

RUN_S = 60.0


def train(steps_until: float) -> int:
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    step = 0
    while time.monotonic() < steps_until:
        h = x @ w
        h = h @ w
        h = h @ w
        h = h @ w
        torch.cuda.synchronize()
        step += 1
    return step


if __name__ == "__main__":
    train(time.monotonic() + RUN_S)
