"""The CUDA coredump's table layouts, as NVIDIA's public cudacoredump.h describes them.

Rows grow with driver versions, so every field is read by offset and only
when the section's ``sh_entsize`` is large enough to hold it. ``baseline``
is the row size of the oldest layout we accept: anything smaller is a lie.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

SHT_LOUSER = 0x80000000

# Section types (CudbgSectionHeaderTypes).
SHT_DEV_REGS = SHT_LOUSER + 5
SHT_ELF_IMG = SHT_LOUSER + 6
SHT_RELF_IMG = SHT_LOUSER + 7
SHT_BT = SHT_LOUSER + 8
SHT_DEV_TABLE = SHT_LOUSER + 9
SHT_CTX_TABLE = SHT_LOUSER + 10
SHT_SM_TABLE = SHT_LOUSER + 11
SHT_GRID_TABLE = SHT_LOUSER + 12
SHT_CTA_TABLE = SHT_LOUSER + 13
SHT_WP_TABLE = SHT_LOUSER + 14
SHT_LN_TABLE = SHT_LOUSER + 15
SHT_MOD_TABLE = SHT_LOUSER + 16
SHT_META_DATA = SHT_LOUSER + 22

EM_CUDA = 190
ET_CORE = 4

# CUDBGException_t, without the CUDBG_EXCEPTION_ prefix.
EXCEPTIONS = {
    0: "NONE",
    1: "LANE_ILLEGAL_ADDRESS",
    2: "LANE_USER_STACK_OVERFLOW",
    3: "DEVICE_HARDWARE_STACK_OVERFLOW",
    4: "WARP_ILLEGAL_INSTRUCTION",
    5: "WARP_OUT_OF_RANGE_ADDRESS",
    6: "WARP_MISALIGNED_ADDRESS",
    7: "WARP_INVALID_ADDRESS_SPACE",
    8: "WARP_INVALID_PC",
    9: "WARP_HARDWARE_STACK_OVERFLOW",
    10: "DEVICE_ILLEGAL_ADDRESS",
    11: "LANE_MISALIGNED_ADDRESS",
    12: "WARP_ASSERT",
    13: "LANE_SYSCALL_ERROR",
    14: "WARP_ILLEGAL_ADDRESS",
    15: "LANE_NONMIGRATABLE_ATOMSYS",
    16: "LANE_INVALID_ATOMSYS",
    17: "CLUSTER_OUT_OF_RANGE_ADDRESS",
    18: "CLUSTER_BLOCK_NOT_PRESENT",
    19: "WARP_STACK_CANARY",
    20: "WARP_TMEM_ACCESS_CHECK",
    21: "WARP_TMEM_LEAK",
    22: "WARP_CALL_REQUIRES_NEWER_DRIVER",
    0xFFFFFFFF: "UNKNOWN",
}

# CUDBGGridStatus.
GRID_STATUS = {
    0: "invalid",
    1: "pending",
    2: "active",
    3: "sleeping",
    4: "terminated",
    5: "undetermined",
}


def exception_name(code: int) -> str:
    return EXCEPTIONS.get(code, f"EXCEPTION_{code}")


@dataclass(frozen=True)
class Layout:
    """One table's row: name -> (offset, struct format), and the smallest valid row."""

    name: str
    fields: dict[str, tuple[int, str]]
    baseline: int

    def decode(self, buf: memoryview | bytes, start: int, entsize: int) -> dict[str, int | None]:
        row: dict[str, int | None] = {}
        for field, (offset, fmt) in self.fields.items():
            if offset + struct.calcsize(fmt) <= entsize:
                row[field] = struct.unpack_from(fmt, buf, start + offset)[0]
            else:
                row[field] = None
        return row


def _layout(name: str, baseline: int, *fields: tuple[str, str]) -> Layout:
    """Lay fields out one after another with C alignment, as the header does."""
    table: dict[str, tuple[int, str]] = {}
    offset = 0
    for field, fmt in fields:
        size = struct.calcsize("<" + fmt)
        offset = (offset + size - 1) // size * size
        table[field] = (offset, "<" + fmt)
        offset += size
    return Layout(name, table, baseline)


DEVICE = _layout(
    "device table", 72,
    ("devName", "Q"), ("devType", "Q"), ("smType", "Q"),
    ("devId", "I"), ("pciBusId", "I"), ("pciDevId", "I"), ("numSMs", "I"),
    ("numWarpsPerSM", "I"), ("numLanesPerWarp", "I"), ("numRegsPerLane", "I"),
    ("numPredicatesPrLane", "I"), ("smMajor", "I"), ("smMinor", "I"),
    ("instructionSize", "I"), ("status", "I"),
)

CONTEXT = _layout(
    "context table", 40,
    ("contextId", "Q"), ("sharedWindowBase", "Q"), ("localWindowBase", "Q"),
    ("globalWindowBase", "Q"), ("deviceIdx", "I"), ("tid", "I"),
)

MODULE = _layout("module table", 8, ("moduleHandle", "Q"))

GRID = _layout(
    "grid table", 104,
    ("gridId64", "Q"), ("contextId", "Q"), ("function", "Q"), ("functionEntry", "Q"),
    ("moduleHandle", "Q"), ("parentGridId64", "Q"), ("paramsOffset", "Q"),
    ("kernelType", "I"), ("origin", "I"), ("gridStatus", "I"), ("numRegs", "I"),
    ("gridDimX", "I"), ("gridDimY", "I"), ("gridDimZ", "I"),
    ("blockDimX", "I"), ("blockDimY", "I"), ("blockDimZ", "I"),
    ("attrLaunchBlocking", "I"), ("attrHostTid", "I"),
    ("clusterDimX", "I"), ("clusterDimY", "I"), ("clusterDimZ", "I"),
)

SM = _layout(
    "SM table", 8,
    ("smId", "I"), ("padding0", "I"),
    ("exception", "I"), ("errorPCValid", "I"), ("errorPC", "Q"),
)

CTA = _layout(
    "CTA table", 24,
    ("gridId64", "Q"), ("blockIdxX", "I"), ("blockIdxY", "I"), ("blockIdxZ", "I"),
)

WARP = _layout(
    "warp table", 32,
    ("errorPC", "Q"), ("warpId", "I"), ("validLanesMask", "I"), ("activeLanesMask", "I"),
    ("isWarpBroken", "I"), ("errorPCValid", "I"),
)

LANE = _layout(
    "lane table", 48,
    ("virtualPC", "Q"), ("physPC", "Q"), ("ln", "I"),
    ("threadIdxX", "I"), ("threadIdxY", "I"), ("threadIdxZ", "I"),
    ("exception", "I"), ("callDepth", "I"), ("syscallCallDepth", "I"), ("ccRegister", "I"),
)

META = _layout(
    "metadata", 32,
    ("generatorName", "Q"), ("driverVersionMajor", "I"), ("driverVersionMinor", "I"),
    ("cudaDriverVersionMajor", "I"), ("cudaDriverVersionMinor", "I"),
    ("flags", "I"), ("timestamp", "I"),
)
