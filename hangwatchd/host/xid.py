"""NVIDIA's XID catalogue, the one table, and the kernel log's ``NVRM: Xid`` lines read into facts.

An XID is the driver's report of a GPU error. Who is at fault decides what it
means for a hang: NVIDIA's catalogue sorts every XID by the action it calls
for, and that sorts them into two kinds here:

- ``application``: the program running on the GPU did it (13: an exception in a
  kernel, 31: an illegal address, 43: a channel the driver stopped, 45: a
  channel ended because its process was), and the remedy is to restart (and
  fix) the application. It is blamed on its own process only; for any other
  process on the GPU it is context, never the cause of its hang.
- ``gpu``: the GPU or the node is at fault (ECC, NVLink, the bus, GSP, timeouts
  inside the GPU). It may explain the hang of any process on that GPU, and is
  recorded against the GPU in the ledger (``incidents/ledger.py``).

Source: "Analyzing Xid Errors with the Xid Catalog",
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html (the
catalogue for Ampere and newer, driver r555 to r590): the mnemonic, the
"Resolution Bucket (Immediate Action)" column, abbreviated below. XIDs not in
this table are ``unknown``: never blamed on anyone, shown as they came.

The kernel log says which process a channel belonged to (``pid=``, the name of
its thread), the GPU by PCI address, and for some XIDs more (the faulting
engine, "caused by previous Xid 149", a recovery action). The lines look like
(each seen in the field, several formats across drivers):

    NVRM: Xid (PCI:0000:18:00): 31, pid=2149, name=python3, Ch 00000008, intr 10000000. MMU Fault: ...
    NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on ...
    NVRM: Xid (PCI:0000:0a:00): 45, pid='<unknown>', name=<unknown>, Ch 00000008
    NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149
    NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.
    NVRM: Xid (PCI:0000:65:00): 64, pid='N/A', Row Remapper: Failed to remap row
    NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:9b:00): 94, pid=1234, name=python3, Contained ECC error
    NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, ...
    NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 ...)
    NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)
    NVRM: Xid (0000:03:00): 13, 0001 00000000 0000a097 00001b0c 00001000 00000000   (older drivers: no "PCI:")

Standard library only; every parse is total (any text in, a fact or None out).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

APPLICATION, GPU, UNKNOWN = "application", "gpu", "unknown"

CATALOGUE_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

# xid: (what it is, whose fault: APPLICATION or GPU, NVIDIA's immediate action)
CATALOGUE: dict[int, tuple[str, str, str]] = {
    8: ("GPU stopped processing (channel idle timeout)", APPLICATION, "RESTART_APP"),
    13: ("graphics engine exception", APPLICATION, "RESTART_APP"),
    31: ("GPU memory page fault", APPLICATION, "RESTART_APP"),
    32: ("invalid or corrupted push buffer stream", APPLICATION, "RESTART_APP"),
    43: ("GPU stopped processing", APPLICATION, "RESTART_APP"),
    45: ("channel ended early (preemptive cleanup)", APPLICATION, "RESTART_APP"),
    46: ("GPU stopped processing (GPU timeout)", GPU, "RESET_GPU"),
    48: ("double-bit ECC error", GPU, "RESET_GPU"),
    62: ("internal micro-controller halt", GPU, "RESET_GPU"),
    63: ("ECC page retirement or row remapping recorded", GPU, "IGNORE"),
    64: ("ECC page retirement or row remapping failed", GPU, "RESET_GPU"),
    68: ("video decoder exception", APPLICATION, "RESTART_APP"),
    69: ("graphics engine class error", APPLICATION, "RESTART_APP"),
    74: ("NVLink error", GPU, "WORKFLOW_NVLINK_ERR"),
    79: ("fell off the bus", GPU, "RESTART_BM"),
    92: ("high single-bit ECC error rate", GPU, "IGNORE"),
    94: ("contained ECC error", GPU, "RESTART_APP"),
    95: ("uncontained ECC error", GPU, "RESET_GPU"),
    109: ("context switch timeout", GPU, "RESET_GPU"),
    110: ("security fault", GPU, "RESET_GPU"),
    119: ("GSP RPC timeout", GPU, "RESET_GPU"),
    120: ("GSP error", GPU, "RESET_GPU"),
    136: ("NVLink training failure", GPU, "RESET_GPU"),
    140: ("unrecoverable ECC error escaped containment", GPU, "RESET_GPU"),
    143: ("GPU initialisation failure", GPU, "RESET_GPU"),
    144: ("NVLink SAW error", GPU, "WORKFLOW_NVLINK5_ERR"),
    145: ("NVLink RLW error", GPU, "WORKFLOW_NVLINK5_ERR"),
    146: ("NVLink TLW error", GPU, "WORKFLOW_NVLINK5_ERR"),
    147: ("NVLink TREX error", GPU, "WORKFLOW_NVLINK5_ERR"),
    148: ("NVLink NVLPW control error", GPU, "WORKFLOW_NVLINK5_ERR"),
    149: ("NVLink NETIR error", GPU, "WORKFLOW_NVLINK5_ERR"),
    150: ("NVLink MSE error", GPU, "WORKFLOW_NVLINK5_ERR"),
    154: ("GPU recovery action changed", GPU, "FOLLOW_RECOVERY_ACTION"),
    155: ("NVLink software-defined error", GPU, "RESET_GPU"),
    156: ("resource retirement event", GPU, "RESET_GPU"),
    158: ("GPU fatal timeout", GPU, "RESET_GPU"),
}

# The catalogue's actions that take the GPU (or the node) out of service until it is reset or rebooted.
RESET_ACTIONS = frozenset({"RESET_GPU", "RESTART_BM", "WORKFLOW_NVLINK_ERR"})

# NVML's nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), the same codes XID 154 logs.
RECOVERY_ACTIONS: dict[int, str] = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain peer-to-peer traffic",
                                    4: "drain and reset", 5: "recover the IMEX domain", 6: "bus reset", 7: "system reboot"}


def describe(xid: int) -> str:
    return CATALOGUE.get(xid, ("an XID error", UNKNOWN, ""))[0]


def kind(xid: int, cause: int | None = None) -> str:
    """Whose fault an XID is: APPLICATION, GPU or UNKNOWN. One the driver says another XID caused
    (45 "caused by previous Xid 149") is of its cause's kind: the channel ended because the GPU failed."""
    if cause is not None and cause != xid and cause in CATALOGUE:
        return CATALOGUE[cause][1]
    return CATALOGUE.get(xid, ("", UNKNOWN, ""))[1]


def action(xid: int) -> str:
    return CATALOGUE.get(xid, ("", UNKNOWN, ""))[2]


def needs_reset(xid: int) -> bool:
    """Whether NVIDIA's catalogue takes the GPU out of service until a reset (or a reboot)."""
    return action(xid) in RESET_ACTIONS


def recovery_name(code: int | None) -> str | None:
    return None if code is None else RECOVERY_ACTIONS.get(code, f"recovery action {code}")


# -- the kernel log's lines ---------------------------------------------------------

MAX_DETAIL = 300  # characters of a line's rest kept (an NVLink line's registers, an MMU fault's address)

# Anchored: the driver's record begins with "NVRM: Xid" (after a dmesg time stamp, in plain text). Text
# elsewhere in a record is anyone's: the kernel logs a segfault with the name of the file mapped where
# it happened ("python3[7]: segfault at ... in NAME[7f..+1000]"), and a user may name a file like an XID line.
_XID = re.compile(r"\s*(?:\[[\s\d.]{1,32}\]\s*)?NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})(?:\.[0-7])?\):\s*"
                  r"(?P<xid>\d{1,5}),?\s*(?P<rest>.*)")
_PID = re.compile(r"pid\s*=\s*(?P<pid>\d{1,10}|'[^']{0,32}'|<[^>]{0,32}>|N/A)\s*,?\s*")
_NAME = re.compile(r"name\s*=\s*(?P<name>[^,]{0,64}?)\s*(?:,\s*|$)")
_CAUSE = re.compile(r"caused by previous Xid (?P<cause>\d{1,5})")
_RECOVERY = re.compile(r"recovery action changed from 0x(?P<old>[0-9A-Fa-f]{1,8})[^)]*\) to 0x(?P<new>[0-9A-Fa-f]{1,8})")
_PCI_KEY = re.compile(r"(?:PCI:)?(?P<domain>[0-9A-Fa-f]{1,8}):(?P<bus>[0-9A-Fa-f]{1,2}):(?P<dev>[0-9A-Fa-f]{1,2})")


@dataclass(frozen=True)
class XidLine:
    """What one ``NVRM: Xid`` line says."""

    pci: str  # the GPU, as pci_key() writes it: "0000:18:00"
    xid: int
    pid: int | None  # the process whose channel it was; None where the driver named none ('<unknown>', N/A)
    name: str | None  # its thread's name, as the driver logged it (at most 64 characters)
    detail: str  # the rest of the line, at most MAX_DETAIL characters, printable
    cause: int | None  # "caused by previous Xid N"
    recovery: int | None  # XID 154's new recovery action (RECOVERY_ACTIONS)

    @property
    def kind(self) -> str:
        return kind(self.xid, self.cause)


def pci_key(text: str) -> str | None:
    """A GPU's PCI address in one spelling, from the kernel's ("PCI:0000:18:00"), NVML's
    ("00000000:18:00.0") or /proc/driver/nvidia's ("0000:18:00.0"): "0000:18:00"."""
    m = _PCI_KEY.search(text or "")
    if not m:
        return None
    return f"{int(m.group('domain'), 16):04x}:{int(m.group('bus'), 16):02x}:{int(m.group('dev'), 16):02x}"


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def parse_line(message: str) -> XidLine | None:
    """The facts of an ``NVRM: Xid`` line (a kernel log message), or None when it is not one."""
    m = _XID.match(message)
    if not m:
        return None
    pci = pci_key(m.group("pci"))
    number = int(m.group("xid"))
    if pci is None or number > 0xFFFF:
        return None
    rest = m.group("rest")
    pid: int | None = None
    name: str | None = None
    p = _PID.match(rest)
    if p:
        pid = int(p.group("pid")) if p.group("pid").isdigit() else None
        rest = rest[p.end():]
    n = _NAME.match(rest)
    if n:
        name = _printable(n.group("name").strip()) or None
        if name in ("<unknown>", "N/A"):
            name = None
        rest = rest[n.end():]
    c = _CAUSE.search(rest)
    r = _RECOVERY.search(rest) if number == 154 else None
    return XidLine(pci, number, pid if pid else None, name, _printable(rest.strip())[:MAX_DETAIL],
                   int(c.group("cause")) if c else None, int(r.group("new"), 16) if r else None)
