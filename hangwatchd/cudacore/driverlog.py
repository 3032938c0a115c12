"""The CUDA driver's ``coredump:`` progress lines on a workload's stderr.

They are sometimes the only evidence: a driver can report an exception and
write no dump (the graph_ima fixture). This reads what they say.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .cubin import demangle

_LINE = re.compile(r"\bcoredump: ")
_EXC = re.compile(r"Detected an exception of type CUDBG_EXCEPTION_(\w+)")
_FIELD = re.compile(r"- (Device|SM|Warp): (\d+)")
_PC = re.compile(r"- PC (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r"#0\s+(0x[0-9a-fA-F]+)\s+(\S+)")
_FILE = re.compile(r"Writing ELF file to (\S+)")


def is_driver_line(line: str) -> bool:
    return bool(_LINE.search(line))


@dataclass(frozen=True)
class DriverReport:
    exception: str | None
    device: int | None
    sm: int | None
    warp: int | None
    pc: int | None
    kernel_mangled: str | None
    dump_file: str | None
    done: bool

    @property
    def kernel(self) -> str | None:
        return demangle(self.kernel_mangled) if self.kernel_mangled else None

    def summary(self) -> str:
        what = self.exception or "a GPU coredump"
        where = f" in {self.kernel}" if self.kernel else ""
        at = f" on device {self.device}, SM {self.sm}, warp {self.warp}" if self.device is not None else ""
        return f"{what}{where}{at}"


def parse(lines: list[str]) -> DriverReport:
    fields: dict[str, int] = {}
    exc = pc = mangled = dump = None
    done = False
    for line in lines:
        if not is_driver_line(line):
            continue
        if m := _EXC.search(line):
            exc = m.group(1)
        elif m := _FIELD.search(line):
            fields.setdefault(m.group(1), int(m.group(2)))
        elif m := _PC.search(line):
            pc = int(m.group(1), 16)
        elif (m := _FRAME.search(line)) and mangled is None:
            mangled = m.group(2)
        elif m := _FILE.search(line):
            dump = m.group(1)
        elif "All done" in line:
            done = True
    return DriverReport(exc, fields.get("Device"), fields.get("SM"), fields.get("Warp"), pc, mangled, dump, done)
