"""``python -m hangwatchd.capture.nvml_probe PID``: one JSON object about the GPUs, on stdout.

Exit status 3 with one line on stderr when NVML does not apply here (no
library, no driver, no GPU): the step reads n/a. Exit status 1 when NVML is
there and fails.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def probe(pid: int) -> dict[str, Any]:
    import pynvml as nv

    nv.nvmlInit()
    try:
        out: dict[str, Any] = {"driver": _s(nv.nvmlSystemGetDriverVersion()), "devices": [], "process_gpus": []}
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            dev: dict[str, Any] = {"index": i, "name": _s(nv.nvmlDeviceGetName(h)), "uuid": _s(nv.nvmlDeviceGetUUID(h))}
            for key, fn in (
                ("utilization_percent", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                ("memory_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
                ("memory_total_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).total),
                ("power_watts", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000),
                ("temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            ):
                try:
                    dev[key] = fn()
                except nv.NVMLError as exc:
                    dev[key] = None
                    dev.setdefault("errors", []).append(f"{key}: {exc}")
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
            except nv.NVMLError:
                procs = []
            dev["processes"] = [{"pid": p.pid, "used_memory_bytes": p.usedGpuMemory} for p in procs]
            if any(p.pid == pid for p in procs):
                out["process_gpus"].append(i)
            out["devices"].append(dev)
        out["xid"] = "not collected: XID events need a listener running before the error"
        return out
    finally:
        nv.nvmlShutdown()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _absent(exc: Exception) -> bool:
    """NVML's own way of saying there is nothing to ask: no libnvidia-ml, no driver loaded, no GPU."""
    import pynvml as nv

    absent = tuple(getattr(nv, n) for n in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded",
                                             "NVMLError_NoPermission", "NVMLError_NotFound") if hasattr(nv, n))
    return isinstance(exc, absent) or isinstance(exc, OSError)


def main() -> int:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        print("NVML is not available here: pip install nvidia-ml-py on a machine with an NVIDIA driver", file=sys.stderr)
        return 3
    try:
        data = probe(int(sys.argv[1]))
    except Exception as exc:  # noqa: BLE001 - the library's errors vary by driver; one line is what we owe
        if _absent(exc):
            print(f"no NVIDIA driver or GPU here ({exc})", file=sys.stderr)
            return 3
        print(f"NVML failed: {exc}", file=sys.stderr)
        return 1
    json.dump(data, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
