"""The host waits on the GPU while another thread holds the GIL: the main thread launches a
2-second kernel and waits in ``torch.cuda.synchronize()`` (which releases the GIL); meanwhile
the telemetry thread (``read_telemetry``) calls libc ``read()`` through ``ctypes.PyDLL`` on a
pipe nobody writes, holding the GIL. The kernel finishes, but the main thread can never take
the GIL back to return from ``synchronize``.

Reports: python/cpython#114150 (a C call through PyDLL keeps the GIL); giampaolo/psutil#1425
("identify all the C calls which are potentially blocking and release the GIL around them").
"""

import ctypes
import os
import threading
import time

import torch

CASE = {
    "title": "cudaStreamSynchronize returns, but another thread holds the GIL in a blocking read",
    "source": "python/cpython#114150; giampaolo/psutil#1425 (a blocking C call that keeps the GIL)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["read_telemetry", "telemetry"],
    "cause": r"GIL",
    "hangs_after": 3,
    "needs": ["gpu"],
}

libc = ctypes.PyDLL(None)
tele_r, tele_w = os.pipe()  # kept open, never written


def read_telemetry() -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = libc.read(tele_r, buf, 256)
    return buf.raw[:n]


def main() -> None:
    x = torch.randn(64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second or two of GPU cycles
    threading.Thread(target=read_telemetry, name="telemetry", daemon=True).start()
    torch.cuda.synchronize()  # returns in C after the kernel; cannot re-enter Python
    print(float(x.sum()))
    time.sleep(3600)


if __name__ == "__main__":
    main()
