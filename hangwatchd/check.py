"""``hangwatchd check``: can this node do the job? One screen, each part checked for real."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config
from .cudacore.cudagdb import find_cuda_gdb
from .cudacore.nvdisasm import INSTALL_HINT, find_nvdisasm
from .host import subproc
from .host.pyspy_binary import find_pyspy, ptrace_hint

CAP_SYS_PTRACE = 19


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


def _ptrace() -> Check:
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        scope = None
    cap = False
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            cap = bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    scope_text = f"kernel.yama.ptrace_scope={scope}" if scope is not None else "no Yama LSM"
    if scope == "3":
        return Check("ptrace", False, f"{scope_text} forbids ptrace even for root; set it to 1 or lower")
    if cap:
        return Check("ptrace", True, f"CAP_SYS_PTRACE held, {scope_text}")
    if scope in (None, "0"):
        return Check("ptrace", True, f"no CAP_SYS_PTRACE, but {scope_text}: processes of this user only (uid {os.geteuid()})")
    return Check("ptrace", False, f"no CAP_SYS_PTRACE with {scope_text}: {ptrace_hint()}")


def _pyspy() -> Check:
    tool = find_pyspy()
    if tool is None:
        return Check("py-spy", False, "not installed: pip install py-spy")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        import time

        time.sleep(0.3)
        res = subproc.run([tool, "dump", "--pid", str(child.pid)], timeout=10)
    finally:
        child.kill()
        child.wait()
    if res.ok:
        return Check("py-spy", True, f"{tool} read a test child's stack in {res.seconds:.2f} s")
    return Check("py-spy", False, f"{tool} could not read a test child: {res.stderr_line() or 'timed out'} ({ptrace_hint()})")


def _stack_probe() -> Check:
    """The stack probe's helper reads a test child (optional: without it py-spy reads every sample)."""
    import time

    from .detect.stack_probe import StackProbe

    probe = StackProbe()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        started = time.monotonic()
        got = probe.probe(child.pid, started + 10)
    finally:
        probe.close()
        child.kill()
        child.wait()
    if got is not None:
        return Check("stack probe", True, f"pystack read a test child in {time.monotonic() - started:.2f} s", required=False)
    return Check("stack probe", False, f"could not read a test child ({probe.unavailable or ptrace_hint()}): py-spy reads "
                 "every stack sample, at more CPU (pip install pystack)", required=False)


def _nvdisasm() -> Check:
    tool = find_nvdisasm()
    if tool is None:
        return Check("nvdisasm", False, f"not found: GPU dumps give kernels and PCs but no source lines; {INSTALL_HINT}", False)
    res = subproc.run([tool, "--version"], timeout=10)
    version = next((ln for ln in res.stdout.decode(errors="replace").splitlines() if "release" in ln), "").strip()
    return Check("nvdisasm", res.ok, f"{tool} {version}".strip(), False)


def _nvml() -> Check:
    res = subproc.run([sys.executable, "-m", "hangwatchd.capture.nvml_probe", str(os.getpid())], timeout=15)
    if res.timed_out:
        return Check("NVML", False, "the NVML probe hung for 15 s and was killed", False)
    if not res.ok:
        return Check("NVML", False, res.stderr_line() or "the NVML probe failed", False)
    import json

    data = json.loads(res.stdout)
    names = ", ".join(f"{d['index']}: {d['name']}" for d in data.get("devices", []))
    return Check("NVML", True, f"driver {data.get('driver')}, GPUs {names or 'none'}", False)


def _kernel_log(path: str) -> Check:
    """Whether the NVRM Xid lines can be read (they name the process behind each GPU fault); optional:
    without them XIDs come from NVML alone, and an application's XID is never blamed on anyone."""
    if not path:
        return Check("kernel log", True, "not read (kernel_log = \"\"): XIDs from NVML alone, without their process", False)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        hint = ("; run as root (CAP_SYSLOG where kernel.dmesg_restrict = 1; the systemd unit and the DaemonSet allow it)"
                if exc.errno in (errno.EACCES, errno.EPERM) else "")
        return Check("kernel log", False, f"cannot read {path}: {exc.strerror}{hint}; XIDs then come from NVML alone, "
                     "without the process that caused them", False)
    os.close(fd)
    return Check("kernel log", True, f"{path} is readable: each XID is told with its process", False)


def _cuda_gdb() -> Check:
    tool = find_cuda_gdb()
    return Check("cuda-gdb", tool is not None, tool or "not installed (optional: only for --cuda-gdb cross-checks)", False)


def _writable(name: str, path: Path) -> Check:
    """Whether the daemon could write there, only looked at: nothing is created (a dir missing
    is judged by the nearest dir that exists, where the daemon would create it)."""
    flag = f"--{name.replace(' ', '-')}"
    here = path
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        return Check(name, False, f"{path}: {here} is not a directory; pass another {flag} or move that file away")
    if not _can_write(here):
        why = "is on a read-only file system" if _read_only(here) else f"is not writable by uid {os.geteuid()}"
        return Check(name, False, f"{path}: {here} {why}; pass another {flag} or fix its permissions")
    if here != path:
        return Check(name, True, f"{path} does not exist yet; the daemon creates it ({here} is writable)")
    return Check(name, True, f"{path} is writable")


def _can_write(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK) and not _read_only(path)


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _port(address: str, runtime_dir: Path, daemon: dict[str, Any] | None) -> Check:
    """Is the metrics address free, or the running daemon's own? ``daemon``: its daemon.json."""
    theirs = str((daemon or {}).get("metrics_address") or "")
    if daemon and theirs and theirs.rpartition(":")[2] == address.rpartition(":")[2]:
        # After `systemctl enable --now` the port is the daemon's own: that is the node working.
        answer = _scrape(theirs)
        if answer is not None:
            return Check("metrics port", False, f"{theirs} is the running daemon's (pid {daemon.get('pid')}), but it "
                                                f"does not answer ({answer}); see journalctl -u hangwatchd")
        return Check("metrics port", True, f"{theirs} is in use by the running daemon (pid {daemon.get('pid')}, "
                                           f"version {daemon.get('version')}), which answers /metrics")
    serving = (f"; the running daemon (pid {daemon.get('pid')}) serves " + (f"on {theirs}" if theirs else "no metrics")
               if daemon else "")
    if not address:
        return Check("metrics port", True, "metrics are off (metrics_address = \"\")" + serving)
    host, _, port = address.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host or "0.0.0.0", int(port)))
    except OSError as exc:
        return Check("metrics port", False, f"{address}: {exc.strerror}, and not by a hangwatchd daemon on "
                                            f"{runtime_dir}{serving}; free it or set metrics_address")
    return Check("metrics port", True, f"{address} is free{serving}")


def _scrape(address: str) -> str | None:
    """Why the daemon's /metrics does not answer; None when it does."""
    import urllib.request

    host, _, port = address.rpartition(":")
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=3) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except OSError as exc:
        return str(getattr(exc, "reason", None) or exc)


def _inotify() -> Check:
    base = Path("/proc/sys/fs/inotify")
    try:
        watches = int((base / "max_user_watches").read_text())
        instances = int((base / "max_user_instances").read_text())
    except (OSError, ValueError):
        return Check("inotify", False, "no /proc/sys/fs/inotify: this kernel has no inotify")
    ok = watches >= 64 and instances >= 8
    return Check("inotify", ok, f"max_user_watches={watches}, max_user_instances={instances}"
                 + ("" if ok else "; raise them with sysctl fs.inotify.max_user_instances=128"))


def run_checks(config: Config, daemon: dict[str, Any] | None = None) -> list[Check]:
    """Every check, looking only: nothing is created or changed. ``daemon``: the running daemon's
    daemon.json, whose dirs and metrics address ``config`` holds already (see the CLI)."""
    return [
        _ptrace(), _pyspy(), _stack_probe(), _nvdisasm(), _nvml(), _kernel_log(config.kernel_log), _cuda_gdb(),
        _writable("state dir", Path(config.state_dir)), _writable("runtime dir", Path(config.runtime_dir)),
        _writable("dump dir", config.dumps), _port(config.metrics_address, Path(config.runtime_dir), daemon), _inotify(),
    ]


def render(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        mark = "ok" if c.ok else ("FAIL" if c.required else "warn")
        lines.append(f"{mark:<5} {c.name:<13} {c.detail}")
    failed = [c.name for c in checks if c.required and not c.ok]
    lines.append("")
    lines.append("this node can run hangwatchd" if not failed else f"this node cannot run hangwatchd yet: fix {', '.join(failed)}")
    return "\n".join(lines) + "\n"
