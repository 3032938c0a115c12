"""A stream that waits for something that never happens: ``wait_for_producer`` makes the
compute stream wait (``cuStreamWaitValue32``) until a flag in device memory reaches 1; the
producer that writes it was to run in another process and never started. The kernels queued
behind the wait never run; the host waits in ``cudaStreamSynchronize`` while nothing runs on
the GPU for this process.

(A ``cudaStreamWaitEvent`` on an event that was never recorded returns at once in CUDA, which
is why code that needs "wait until later" uses a wait on a value, as below.)

Reports: sgl-project/sglang#14214 ("Add cuda event based on waiting value: for the scenarios
where the record happens later than the wait"); pytorch/pytorch#196133 (a replay stream wedged
behind a wait: the host synchronize never returns).
"""

import ctypes

import torch

CASE = {
    "title": "stream waits on a value nothing writes (cuStreamWaitValue32)",
    "source": "sgl-project/sglang#14214; pytorch/pytorch#196133 (a stream wedged behind a wait)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["wait_for_producer", "cuStreamWaitValue32"],
    "cause": r"never (runs|written|recorded)|nothing (runs|writes)|waits? (on|for) (a value|the stream|gpu work)",
    "hangs_after": 3,
    "needs": ["gpu"],
}

CU_STREAM_WAIT_VALUE_GEQ = 0x0


def wait_for_producer(stream: torch.cuda.Stream, flag: torch.Tensor) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = getattr(cuda, "cuStreamWaitValue32_v2", None) or cuda.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    rc = fn(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(flag.data_ptr()), 1, CU_STREAM_WAIT_VALUE_GEQ)
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {rc}")


def main() -> None:
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    wait_for_producer(stream, flag)
    with torch.cuda.stream(stream):
        y = x @ x  # queued behind the wait
    stream.synchronize()
    print(float(y.sum()))


if __name__ == "__main__":
    main()
