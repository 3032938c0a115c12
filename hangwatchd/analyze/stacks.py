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


def load_threads(process_dir: Path) -> list[dict[str, Any]] | None:
    for name in ("pyspy-native.json", "pyspy.json"):
        try:
            data = json.loads((process_dir / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, list):
            return data
    return None


def gpu_wait(process_dir: Path) -> str | None:
    """The first native frame that waits on the GPU or a collective, if any thread shows one."""
    for thread in load_threads(process_dir) or []:
        for frame in thread.get("frames") or []:
            name = str(frame.get("name") or "")
            if any(w in name for w in GPU_WAITS + COLLECTIVE_WAITS):
                return name
    return None
