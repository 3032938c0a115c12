"""The CUDA driver's ``coredump:`` progress lines on a workload's stderr, and the Python
traceback that follows them.

They are sometimes the only evidence: a driver can report an exception and
write no dump (the graph_ima fixture), and the program then dies of the error in
Python: its traceback's innermost frame is the line where the error surfaced.
This reads what they say (user-written text: linear, capped by the caller).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .cubin import demangle

_LINE = re.compile(r"\bcoredump: ")
_EXC = re.compile(r"Detected an exception of type CUDBG_EXCEPTION_(\w+)")
_FIELD = re.compile(r"- (Device|SM|Warp): (\d+)")
_PC = re.compile(r"- PC (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r"#0\s+(0x[0-9a-fA-F]+)\s+(\S+)")
_FILE = re.compile(r"Writing ELF file to (\S+)")
TRACEBACK = "Traceback (most recent call last):"
_TB_FRAME = re.compile(r'^  File "([^"]{1,4096})", line (\d{1,9}), in (.{1,512})$')
TRACEBACK_LINES = 400  # lines of a traceback kept after the driver's report
# What hangwatchd's in-process reporter writes after a CUDA error's traceback: the dying thread's
# last CUDA graph replay, as one traceback frame (workload/introspect/graph_replays.HEADER).
REPLAY_HEADER = "hangwatchd: the last CUDA graph replay in this thread before the error:"
REPLAY_LINES = 2  # its frame: the File line and the code
CODE_CHARS = 500  # of a frame's line of code: the log is the user's to make one line 16 MiB long


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
    frames: tuple[dict[str, Any], ...] = ()  # the traceback after the report, outermost first (py-spy's keys)
    error: str | None = None  # its last line ("torch.AcceleratorError: CUDA error: ...")
    replay: dict[str, Any] | None = None  # the dying thread's last CUDA graph replay, as the reporter told it

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
    frames: list[dict[str, Any]] = []
    error = None
    in_traceback = False
    told: dict[str, Any] | None = None  # the reporter's replay frame
    replay_lines = 0  # lines of the replay's frame still to come after REPLAY_HEADER: its File line, its code
    for line in lines:
        if line == TRACEBACK:
            in_traceback, frames, error = exc is not None, [], None  # the last traceback after the report
            continue
        if line == REPLAY_HEADER:
            replay_lines, in_traceback = (REPLAY_LINES if exc is not None else 0), False
            continue
        if replay_lines:  # a line that is not the frame's own is read as any other
            expected, replay_lines = replay_lines, 0
            if expected == REPLAY_LINES and (m := _TB_FRAME.match(line)):
                told, replay_lines = {"filename": m.group(1), "line": int(m.group(2)), "name": m.group(3)}, 1
                continue
            if expected == 1 and told is not None and line.startswith("    "):
                told["code"] = line.strip()[:CODE_CHARS]
                continue
        if in_traceback:
            if m := _TB_FRAME.match(line):
                frames.append({"filename": m.group(1), "line": int(m.group(2)), "name": m.group(3)})
            elif line.startswith("    ") and frames and "code" not in frames[-1]:
                frames[-1]["code"] = line.strip()[:CODE_CHARS]
            elif line and not line.startswith(" "):
                error, in_traceback = line[:500], False
            continue
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
    return DriverReport(exc, fields.get("Device"), fields.get("SM"), fields.get("Warp"), pc, mangled, dump, done,
                        tuple(frames), error, told)
