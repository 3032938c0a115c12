"""``python -m hangwatchd.capture.nvml_probe PID``: one JSON object about the GPUs, on stdout.

Each device: its name and UUID, utilisation, memory, power and its enforced limit,
temperature, SM clock and its max, why its clocks are held lower (throttle reasons), the
error counters that grow on a sick GPU or link (ECC, PCIe replays, NVLink), its compute
processes and NVML's per-process samples; ``process_gpus``: the GPUs PID runs on (PID 0: none).

Exit status 3 with one line on stderr when NVML does not apply here (no
library, no driver, no GPU): the step reads n/a. Exit status 1 when NVML is
there and fails.
"""

from __future__ import annotations

import json
import sys
import time
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
                ("serial", lambda h=h: _s(nv.nvmlDeviceGetSerial(h))),  # the board's: what a vendor's RMA asks for
                ("pci_bus_id", lambda h=h: _s(nv.nvmlDeviceGetPciInfo(h).busId)),  # how the kernel log names the GPU
                ("utilization_percent", lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                ("memory_used_bytes", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).used),
                ("memory_total_bytes", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).total),
                ("power_watts", lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000),
                ("temperature_c", lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            ):
                try:
                    dev[key] = fn()
                except nv.NVMLError as exc:
                    dev[key] = None
                    dev.setdefault("errors", []).append(f"{key}: {exc}")
            dev.update(slowdown(nv, h, dev.setdefault("errors", [])))
            if not dev["errors"]:
                del dev["errors"]
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
            except nv.NVMLError:
                procs = []
            dev["processes"] = [{"pid": p.pid, "used_memory_bytes": p.usedGpuMemory} for p in procs]
            if any(p.pid == pid for p in procs):
                out["process_gpus"].append(i)
            dev["process_utilization"] = process_samples(nv, h)
            if dev["process_utilization"] is None:
                dev.setdefault("errors", []).append("process_utilization: not supported here")
            out["devices"].append(dev)
        # This process's own share of each of its GPUs: a GPU shared with a busy neighbour reads 100 %
        # device-wide while this process runs nothing on it.
        out["process_sm_percent"] = {
            str(d["index"]): max((s["sm_percent"] for s in d["process_utilization"]["samples"] if s["pid"] == pid), default=0)
            for d in out["devices"] if d["index"] in out["process_gpus"] and d["process_utilization"] is not None}
        out["xid"] = "not collected here: the daemon's listeners (NVML's events, the kernel log) write gpu-events.json"
        return out
    finally:
        nv.nvmlShutdown()


# Why a GPU runs slower than it can (NVML's clock event reasons, formerly "throttle reasons"), by bit.
# The idle and the application's own clocks are left out: they are not a slowdown of a busy GPU.
THROTTLE_REASONS = ((0x4, "power cap"), (0x8, "hardware slowdown"), (0x10, "sync boost"), (0x20, "thermal (software)"),
                    (0x40, "thermal (hardware)"), (0x80, "power brake"), (0x200, "board limit"), (0x400, "reliability"))


def slowdown(nv: Any, h: Any, errors: list[str]) -> dict[str, Any]:
    """What can slow one GPU down: its SM clock against its max and why it is held lower, its power
    against its enforced limit, and the error counters that grow on a sick GPU or link (volatile
    ECC errors, PCIe replays, NVLink replays, recoveries and CRC errors). Each None where NVML
    cannot say (with a line in ``errors``); NVLink only on links that are up."""
    out: dict[str, Any] = {}
    asks = (
        ("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
        ("sm_clock_max_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
        ("throttle_reasons", lambda: [name for bit, name in THROTTLE_REASONS if _reasons(nv, h) & bit]),
        ("power_limit_watts", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000),
        ("ecc_errors", lambda: sum(nv.nvmlDeviceGetTotalEccErrors(h, kind, nv.NVML_VOLATILE_ECC) for kind in
                                   (nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))),
        ("pcie_replays", lambda: nv.nvmlDeviceGetPcieReplayCounter(h)),
        ("nvlink_errors", lambda: _nvlink_errors(nv, h)),
    )
    for key, fn in asks:
        try:
            out[key] = fn()
        except nv.NVMLError as exc:
            out[key] = None
            if "Not Supported" not in str(exc):
                errors.append(f"{key}: {exc}")
    return out


def _reasons(nv: Any, h: Any) -> int:
    ask = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(ask(h))


def _nvlink_errors(nv: Any, h: Any) -> int | None:
    """Replay, recovery and CRC errors summed over the links that are up; None on a GPU without NVLink."""
    total, links = 0, 0
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                continue
        except nv.NVMLError:
            continue  # no such link (or no NVLink at all)
        links += 1
        for counter in (nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY, nv.NVML_NVLINK_ERROR_DL_CRC_FLIT):
            try:
                total += int(nv.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
            except nv.NVMLError:
                pass  # a counter this GPU does not keep
    return total if links else None


WINDOW_S = 5  # seconds of NVML's per-process samples read back: recent enough to be the hung state, long enough for a sample


def process_samples(nv: Any, h: Any) -> dict[str, Any] | None:
    """NVML's per-process utilisation samples of the last ``WINDOW_S`` seconds; None where not supported.

    A process that ran nothing on the GPU in the window has no sample: none is 0 %.
    """
    since = int((time.time() - WINDOW_S) * 1e6)
    try:
        samples = nv.nvmlDeviceGetProcessUtilization(h, since)
    except nv.NVMLError as exc:
        # No sample at all comes back as NOT_FOUND (or as "success" with none, which pynvml raises).
        if getattr(exc, "value", None) in (0, getattr(nv, "NVML_ERROR_NOT_FOUND", 6)):
            samples = []
        else:
            return None
    return {"window_s": WINDOW_S, "samples": [
        {"pid": s.pid, "sm_percent": s.smUtil, "memory_percent": s.memUtil, "timestamp_us": s.timeStamp}
        for s in samples if s.timeStamp >= since]}


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
        import pynvml  # noqa: F401 - whether the library is there is the question
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
