"""What a captured native stack says the process is waiting on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Native frames that mean "the host waits for the GPU" or "inside a collective".
GPU_WAITS = (
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cudaDeviceSynchronize",
    "cudaStreamSynchronize", "cudaEventSynchronize", "cuMemcpyDtoH", "cudaMemcpy",
)
COLLECTIVE_WAITS = ("ncclGroupEnd", "ncclAllReduce", "ncclAllGather", "ncclBroadcast", "ncclReduceScatter",
                    "c10d::ProcessGroupNCCL::WorkNCCL::wait", "c10d::ProcessGroupNCCL::WorkNCCL::synchronize")


# Where library code lives; a frame elsewhere is the user's own code.
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", "/hangwatchd/client.py")


def is_user_frame(frame: dict[str, Any]) -> bool:
    filename = frame.get("filename") or ""
    if frame.get("module") or filename.endswith(".so") or ".so." in filename:
        return False  # native code
    return not any(m in filename for m in _LIBRARY_MARKERS)


def load_threads(process_dir: Path) -> list[dict[str, Any]] | None:
    for name in ("pyspy-native.json", "pyspy.json"):
        try:
            data = json.loads((process_dir / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, list):
            return data
    return None


# Libraries whose frames mean the thread is inside the CUDA driver or NCCL: a hung
# process blocked there (even in cuLaunchKernel, behind a full launch queue) waits on the GPU.
GPU_LIBRARIES = ("libcuda.so", "libnccl.so")


def gpu_wait(process_dir: Path) -> str | None:
    """The first native frame that waits on the GPU or a collective, if any thread shows one."""
    frames = [f for t in load_threads(process_dir) or [] for f in t.get("frames") or []]
    for frame in frames:  # a named wait says most
        name = str(frame.get("name") or "")
        if any(w in name for w in GPU_WAITS + COLLECTIVE_WAITS):
            return name
    for frame in frames:
        lib = str(frame.get("short_filename") or "")
        if lib.startswith(GPU_LIBRARIES):
            return f"{frame.get('name')} ({lib})"
    return None
