"""A stream deadlock: a stream waits for a value nothing will write, the host keeps
launching behind it until the driver's launch queue is full, and then blocks in
cuLaunchKernel inside the user's data-prefetch code while the GPU runs nothing."""

import ctypes
import time

import torch

import hangwatchd


def wait_for_value_nobody_writes(stream: torch.cuda.Stream, flag: torch.Tensor) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = getattr(cuda, "cuStreamWaitValue32_v2", None) or cuda.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    rc = fn(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(flag.data_ptr()), 1, 0)  # CU_STREAM_WAIT_VALUE_GEQ
    if rc != 0:
        raise SystemExit(f"cuStreamWaitValue32 failed: {rc}")


def prefetch_next_batch(stream: torch.cuda.Stream, batch: torch.Tensor) -> None:
    with torch.cuda.stream(stream):
        for _ in range(1_000_000):  # the launch queue fills behind the wait: cuLaunchKernel blocks
            batch.add_(1)


def main() -> None:
    x = torch.ones(1024, device="cuda")
    for _ in range(20):
        (x * 2).sum().item()
        hangwatchd.beat()
        time.sleep(0.05)
    stream = torch.cuda.Stream()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    wait_for_value_nobody_writes(stream, flag)
    print(f"STALL {time.time()}", flush=True)
    prefetch_next_batch(stream, x)


if __name__ == "__main__":
    main()
