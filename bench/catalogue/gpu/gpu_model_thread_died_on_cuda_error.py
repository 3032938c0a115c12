"""A serving loop waits on a model thread that died of a CUDA error: the model-runner thread
(``run_model``) hits a device-side illegal address in a kernel; without a GPU dump on exceptions
the RuntimeError ends the thread and the request loop, which beat once per output, waits on the
output queue forever while the HTTP side would keep saying "healthy".

Under ``hangwatchd run`` (CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1) the driver writes the exception's
dump into the daemon's FIFO for the process, from the model-runner thread, blocked in ``out.item()``,
and ends the process once the dump is read: no hang follows. The daemon takes the stacks while the
driver waits, so the incident (reason gpu-exception) names the exception, the Triton kernel with its
line, and the line of ``run_model`` in thread ``model-runner`` where it surfaced.

Reports: vllm-project/vllm#39863 ("EngineCore dies silently while parent remains alive ...
causing service hang"); sgl-project/sglang#514 ("Crash the server when error or OOM happens.
Otherwise, the requests will hang forever").
"""

import queue
import threading

import torch
import triton
import triton.language as tl

import hangwatchd

CASE = {
    "title": "model thread died on a CUDA error; the serving loop waits for its output",
    "source": "vllm-project/vllm#39863; sgl-project/sglang#514 (the engine died, requests hang)",
    "healthy": False,
    "watch": {"heartbeat_timeout": 3},
    "ranks": 1,
    "culprit": ["model-runner", "run_model"],
    "cause": r"exited|died|raised|exception|illegal|CUDA error",
    "hangs_after": 3,
    "needs": ["gpu"],
}

outputs: "queue.Queue[float]" = queue.Queue()


@triton.jit
def gather(out_ptr, src_ptr, idx_ptr):
    i = tl.program_id(0)
    tl.store(out_ptr + i, tl.load(src_ptr + tl.load(idx_ptr + i)))


def run_model(requests: int) -> None:
    src = torch.ones(16, device="cuda")
    for r in range(requests):
        idx = torch.tensor([r if r < 3 else 1 << 40], dtype=torch.int64, device="cuda")  # request 3: a bad index
        out = torch.empty(1, device="cuda")
        gather[(1,)](out, src, idx)
        outputs.put(float(out.item()))


def main() -> None:
    threading.Thread(target=run_model, args=(10,), name="model-runner").start()
    for _ in range(10):
        outputs.get()
        hangwatchd.beat()


if __name__ == "__main__":
    main()
