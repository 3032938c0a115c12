"""A stand-in for ``pynvml`` on a machine without a GPU: NVML's own records, fed from files.

Put this directory first on PYTHONPATH (or load this file as a module) with
$HANGWATCHD_FAKE_NVML naming a directory holding ``gpus`` (how many GPUs) and
``events/NNN.json`` files, each ``{"gpu": 3, "xid": 79}`` (with ``"recovery": 1``:
the recovery action NVML reports for that GPU from then on) or ``{"lost": 2}``.
GPU i sits at PCI 0000:(0x18 + i):00.0 with serial 1650000000 + i; ``processes/I``
(a pid a line) lists the compute processes on GPU I; ``uuid-prefix`` makes the UUIDs
GPU-PREFIX-I (else GPU-fake-I). Everything
else is the real library's: its constants, its error classes, and the records
(``c_nvmlEventData_t``, ``nvmlPciInfo_t``, ``c_nvmlFieldValue_t``) its calls return.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_here = Path(__file__).resolve().parent
_path = next(Path(p) / "pynvml.py" for p in sys.path if p and Path(p).resolve() != _here and (Path(p) / "pynvml.py").is_file())
_spec = importlib.util.spec_from_file_location("_real_pynvml", _path)
assert _spec and _spec.loader
_real = importlib.util.module_from_spec(_spec)
sys.modules["_real_pynvml"] = _real  # it looks itself up there to make its error classes
_spec.loader.exec_module(_real)
globals().update({k: v for k, v in vars(_real).items() if not k.startswith("__")})

BASE = 0x1000
_lost: set[int] = set()
_recovery: dict[int, int] = {}  # GPU index -> the recovery action NVML reports for it


def _dir() -> Path:
    d = os.environ.get("HANGWATCHD_FAKE_NVML")
    if not d:
        raise _real.NVMLError(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
    return Path(d)


def _index(handle: object) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0) - BASE  # type: ignore[arg-type]  # a handle is a c_void_p


def nvmlInit() -> None:
    _dir()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return int((_dir() / "gpus").read_text())


def nvmlDeviceGetHandleByIndex(i: int) -> object:
    return ctypes.cast(ctypes.c_void_p(BASE + i), _real.c_nvmlDevice_t)


def nvmlDeviceGetIndex(handle: object) -> int:
    return _index(handle)


def nvmlDeviceGetMinorNumber(handle: object) -> int:
    return _index(handle)


def nvmlDeviceGetUUID(handle: object) -> str:
    if _index(handle) in _lost:
        raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
    prefix = _dir() / "uuid-prefix"  # two fake nodes, two sets of GPUs: a GPU is its UUID wherever it goes
    return f"GPU-{prefix.read_text().strip() if prefix.is_file() else 'fake'}-{_index(handle)}"


def pci_bus_id(i: int) -> str:
    return f"00000000:{0x18 + i:02X}:00.0"


def nvmlDeviceGetPciInfo(handle: object) -> object:
    i = _index(handle)
    return _real.nvmlPciInfo_t(busIdLegacy=pci_bus_id(i)[4:].encode(), domain=0, bus=0x18 + i, device=0,
                               busId=pci_bus_id(i).encode())


def nvmlDeviceGetSerial(handle: object) -> str:
    return str(1650000000 + _index(handle))


def nvmlDeviceGetFieldValues(handle: object, field_ids: list[int]) -> object:
    values = (_real.c_nvmlFieldValue_t * len(field_ids))()
    for n, field in enumerate(field_ids):
        values[n].fieldId = field
        if field == _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
            values[n].nvmlReturn = _real.NVML_SUCCESS
            values[n].value.uiVal = _recovery.get(_index(handle), 0)
        else:
            values[n].nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
    return values


def nvmlEventSetCreate() -> object:
    return _real.c_nvmlEventSet_t()


def nvmlDeviceRegisterEvents(handle: object, types: int, event_set: object) -> None:
    pass


def nvmlEventSetFree(event_set: object) -> None:
    pass


def nvmlEventSetWait_v2(event_set: object, timeout_ms: int) -> object:
    end = time.monotonic() + timeout_ms / 1000
    events = _dir() / "events"
    while True:
        files = sorted(events.glob("*.json")) if events.is_dir() else []
        if files:
            data = json.loads(files[0].read_text())
            files[0].unlink()
            if "lost" in data:
                _lost.add(int(data["lost"]))
                raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
            if "recovery" in data:
                _recovery[int(data["gpu"])] = int(data["recovery"])
            return _real.c_nvmlEventData_t(device=nvmlDeviceGetHandleByIndex(int(data["gpu"])),
                                           eventType=_real.nvmlEventTypeXidCriticalError, eventData=int(data["xid"]))
        if time.monotonic() >= end:
            raise _real.NVMLError(_real.NVML_ERROR_TIMEOUT)
        time.sleep(0.05)


nvmlEventSetWait = nvmlEventSetWait_v2


# -- a GPU's facts, for the NVML probe (capture/nvml_probe.py), from devices.json when the test writes one:
# {"1": {"sm_clock": 1100, "sm_clock_max": 1980, "reasons": 64, "temperature": 91, "power": 690, "power_limit": 700,
#        "ecc": 0, "pcie_replays": 0, "processes": [{"pid": 1234, "sm": 40}]}}. Without it, every call is the real
# library's (which, with no driver, says so).

class _Facts:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


def _facts(handle: object) -> dict[str, Any] | None:
    path = _dir() / "devices.json"
    if not path.is_file():
        return None
    return dict(json.loads(path.read_text()).get(str(_index(handle))) or {})


def _answer(real_name: str, key: str, default: object = 0) -> object:
    def ask(handle: object, *args: object) -> object:
        facts = _facts(handle)
        if facts is None:
            return getattr(_real, real_name)(handle, *args)
        return facts.get(key, default)
    return ask


def nvmlSystemGetDriverVersion() -> str:
    return "570.00-fake"


def nvmlDeviceGetName(handle: object) -> str:
    return "NVIDIA Fake H200"


def nvmlDeviceGetUtilizationRates(handle: object) -> object:
    facts = _facts(handle)
    if facts is None:
        return _real.nvmlDeviceGetUtilizationRates(handle)
    return _Facts(gpu=facts.get("utilization", 50), memory=10)


def nvmlDeviceGetMemoryInfo(handle: object) -> object:
    facts = _facts(handle)
    if facts is None:
        return _real.nvmlDeviceGetMemoryInfo(handle)
    return _Facts(used=1 << 30, total=141 << 30, free=140 << 30)


nvmlDeviceGetPowerUsage = _answer("nvmlDeviceGetPowerUsage", "power_mw", 300_000)
nvmlDeviceGetEnforcedPowerLimit = _answer("nvmlDeviceGetEnforcedPowerLimit", "power_limit_mw", 700_000)
nvmlDeviceGetCurrentClocksEventReasons = _answer("nvmlDeviceGetCurrentClocksEventReasons", "reasons", 0)
nvmlDeviceGetPcieReplayCounter = _answer("nvmlDeviceGetPcieReplayCounter", "pcie_replays", 0)


def nvmlDeviceGetTemperature(handle: object, sensor: int) -> object:
    facts = _facts(handle)
    return _real.nvmlDeviceGetTemperature(handle, sensor) if facts is None else facts.get("temperature", 50)


def nvmlDeviceGetClockInfo(handle: object, clock: int) -> object:
    facts = _facts(handle)
    return _real.nvmlDeviceGetClockInfo(handle, clock) if facts is None else facts.get("sm_clock", 1980)


def nvmlDeviceGetMaxClockInfo(handle: object, clock: int) -> object:
    facts = _facts(handle)
    return _real.nvmlDeviceGetMaxClockInfo(handle, clock) if facts is None else facts.get("sm_clock_max", 1980)


def nvmlDeviceGetTotalEccErrors(handle: object, kind: int, counter: int) -> object:
    facts = _facts(handle)
    if facts is None:
        return _real.nvmlDeviceGetTotalEccErrors(handle, kind, counter)
    return facts.get("ecc", 0) if kind == _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0


def nvmlDeviceGetNvLinkState(handle: object, link: int) -> object:
    if _facts(handle) is None:
        return _real.nvmlDeviceGetNvLinkState(handle, link)
    raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)  # a PCIe card: no NVLink


def nvmlDeviceGetComputeRunningProcesses(handle: object) -> list[object]:
    """devices.json's processes of this GPU where it has them, else ``processes/I``'s pids."""
    facts = _facts(handle)
    if facts is not None and facts.get("processes") is not None:
        return [_real.c_nvmlProcessInfo_v2_t(pid=p["pid"], usedGpuMemory=1 << 30) for p in facts["processes"]]
    listed = _dir() / "processes" / str(_index(handle))
    pids = [int(w) for w in listed.read_text().split()] if listed.is_file() else []
    return [_real.c_nvmlProcessInfo_v2_t(pid=pid, usedGpuMemory=1 << 30) for pid in pids]


def nvmlDeviceGetProcessUtilization(handle: object, since: int) -> object:
    facts = _facts(handle)
    if facts is None:
        return _real.nvmlDeviceGetProcessUtilization(handle, since)
    now = int(time.time() * 1e6)
    return [_Facts(pid=p["pid"], smUtil=p.get("sm", 0), memUtil=5, timeStamp=now) for p in facts.get("processes") or []]
