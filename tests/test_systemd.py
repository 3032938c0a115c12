"""The shipped unit under a real systemd: systemd as PID 1 in a container (the image ./dev image
builds, plus Debian's systemd), with SYS_ADMIN so it can build the unit's sandbox for real (without
it systemd skips the mount namespace and says "Failed to set up namespace": that fails the test).
Installed as the README says; only the config (gpu_dump = "always") and, for the watchdog test, a
drop-in with a short WatchdogSec differ."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatchd.testing import wait_for

from . import podman
from .conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
UNIT = "hangwatchd.service"
WATCHDOG_S = 3


@pytest.fixture(scope="module")
def systemd_image() -> str:
    podman.require()
    base = podman.image()
    tag = base.replace("localhost/hangwatchd:", "localhost/hangwatchd-systemd:")
    # apt inside the build needs the network (Debian's archive); layers are cached after the first.
    podman.podman("build", "--quiet", "--network=host", *podman.flags(), "--build-arg", f"IMAGE={base}",
                  "-f", str(ROOT / "tests" / "containers" / "systemd.Containerfile"), "--tag", tag, str(ROOT), timeout=600)
    return tag


class Machine(podman.Container):
    def systemctl(self, *args: str, check: bool = True) -> str:
        return self.exec("systemctl", *args, check=check).stdout.strip()

    def show(self, *props: str) -> dict[str, str]:
        out = self.systemctl("show", UNIT, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str | None = None) -> str:
        return self.exec("journalctl", "--no-pager", "-o", "cat", *(["-u", unit] if unit else [])).stdout

    def daemon_events(self) -> list[dict]:
        out = []
        for line in self.journal(UNIT).splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


@pytest.fixture
def machine(systemd_image: str, tmp_path: Path) -> Iterator[Machine]:
    config = tmp_path / "hangwatchd.toml"
    config.write_text(re.sub(r'(?m)^gpu_dump = .*$', 'gpu_dump = "always"', (ROOT / "config" / "hangwatchd.toml").read_text()))
    dropin = tmp_path / "watchdog.conf"
    dropin.write_text(f"[Service]\nWatchdogSec={WATCHDOG_S}s\nRestartSec=1s\n")
    m = Machine(systemd_image, options=[
        "--systemd=always", "--cap-add", "SYS_ADMIN,SYS_PTRACE", "--network", "none",
        "-v", f"{config}:/etc/hangwatchd/hangwatchd.toml:ro",
        "-v", f"{dropin}:/etc/systemd/system/{UNIT}.d/watchdog.conf:ro",
        "-v", f"{FIXTURES / 'cpp_hang'}:/fixtures:ro"])
    try:
        wait_for(lambda: m.systemctl("is-system-running", check=False) in ("running", "degraded"), 60,
                 "systemd's boot", every=0.5)
        yield m
    finally:
        journal = m.journal()
        m.remove()
    # Without SYS_ADMIN (or where the kernel refuses) systemd drops the sandbox and says so.
    assert "Failed to set up namespace" not in journal, journal[-3000:]
    assert "Failed to set up" not in journal, journal[-3000:]


def main_pid(m: Machine) -> int:
    return int(m.show("MainPID")["MainPID"])


def test_the_unit_becomes_ready_by_sd_notify_inside_its_sandbox(machine: Machine) -> None:
    props = machine.show("ActiveState", "SubState", "Type", "StatusText", "NRestarts", "MainPID", "Result")
    assert props["ActiveState"] == "active" and props["SubState"] == "running", props
    assert props["Type"] == "notify" and props["NRestarts"] == "0" and props["Result"] == "success"
    # STATUS= reaches systemd only through the notify socket: readiness came the same way.
    assert props["StatusText"].startswith("watching"), props
    events = [e["event"] for e in machine.daemon_events()]
    assert "daemon_ready" in events
    # Ready means ready: the moment `systemctl restart` returns (Type=notify holds it until
    # READY=1), the new daemon has written daemon.json and serves its metrics.
    machine.systemctl("restart", UNIT)
    props = machine.show("MainPID", "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic")
    info = json.loads(machine.exec("cat", "/run/hangwatchd/daemon.json").stdout)
    assert info["pid"] == int(props["MainPID"])
    assert "hangwatchd_watched_processes" in machine.scrape()
    assert int(props["ActiveEnterTimestampMonotonic"]) > int(props["ExecMainStartTimestampMonotonic"])
    pid = props["MainPID"]
    status = machine.exec("cat", f"/proc/{pid}/status").stdout
    # The sandbox is real: its own mount namespace with / read-only, seccomp on, no new privileges.
    assert re.search(r"^Seccomp:\s+2$", status, re.M) and re.search(r"^NoNewPrivs:\s+1$", status, re.M)
    mnt = machine.exec("readlink", f"/proc/{pid}/ns/mnt", "/proc/1/ns/mnt").stdout.split()
    assert mnt[0] != mnt[1]
    mounts = machine.exec("cat", f"/proc/{pid}/mountinfo").stdout.splitlines()
    root = next(line.split() for line in mounts if line.split()[4] == "/")
    assert "ro" in root[5].split(","), root
    state = next(line.split() for line in mounts if line.split()[4] == "/var/lib/hangwatchd")
    assert "rw" in state[5].split(",")
    # hangwatchd check, as the README runs it right after enable --now, knows the daemon.
    res = machine.exec("/opt/hangwatchd/bin/hangwatchd", "check", check=False)
    assert res.returncode == 0 and "in use by the running daemon" in res.stdout, res.stdout


def test_the_watchdog_restarts_a_daemon_whose_loop_is_stopped(machine: Machine) -> None:
    first = main_pid(machine)
    machine.exec("kill", "-STOP", str(first))
    wait_for(lambda: machine.show("NRestarts")["NRestarts"] == "1", WATCHDOG_S * 5 + 30, "the watchdog's restart", every=0.5)
    wait_for(lambda: machine.show("ActiveState")["ActiveState"] == "active", 30, "the restarted unit", every=0.5)
    assert main_pid(machine) != first
    assert "Watchdog timeout" in machine.journal(UNIT)
    assert machine.exec("kill", "-0", str(first), check=False).returncode != 0  # the stopped one is gone
    # The killed daemon could not remove its temporary directory; the new start emptied it.
    wait_for(lambda: machine.exec("ls", "/var/lib/hangwatchd/tmp").stdout.split(), 30, "the new daemon's pymp-*")
    (left,) = machine.exec("ls", "/var/lib/hangwatchd/tmp").stdout.split()
    assert left.startswith("pymp-")


def test_a_hang_of_another_user_in_another_mount_namespace_is_captured_under_every_directive(machine: Machine) -> None:
    # The workload as a container's process would be: another user, its own mount namespace, its
    # interpreter and files in a tree (/job, a tmpfs) that only exists there.
    script = ("mkdir -p /job && mount -t tmpfs -o mode=0755 tmpfs /job && cp /usr/bin/python3.11 /job/python "
              "&& cp /fixtures/coredump.nvcudmp.xz /job/ && chown -R trainer: /job && cd /job "
              "&& exec runuser -u trainer -- env PYTHONPATH=/opt/hangwatchd/lib/python3.11/site-packages "
              "/opt/hangwatchd/bin/hangwatchd run --heartbeat-timeout 1 -- /job/python -m hangwatchd.testing "
              "gpu-workload --dump /job/coredump.nvcudmp.xz >/run/workload.log 2>&1")
    machine.exec("unshare", "--mount", "--propagation", "private", "sh", "-c", script, detach=True)
    stored = wait_for(lambda: [e for e in machine.daemon_events() if e["event"] == "incident_stored"], 60,
                      "the incident", every=0.5)
    steps = {e["step"]: e for e in machine.daemon_events() if e["event"] == "capture_step"}
    assert steps["pyspy"]["ok"] and not steps["pyspy"]["na"], steps["pyspy"]
    assert steps["cuda_dump"]["ok"] and not steps["cuda_dump"]["na"], json.dumps(steps["cuda_dump"])
    assert steps["flight_recorder"]["ok"] and not steps["flight_recorder"]["na"], steps["flight_recorder"]
    inc = stored[0]["incident"]
    shown = machine.exec("/opt/hangwatchd/bin/hangwatchd", "show", inc).stdout
    # py-spy read the Python stack; the dump was read and explained down to the source line.
    assert "_gpu_workload" in shown and "hangwatchd/testing.py" in shown
    assert "consumer_kernel(int volatile*, int*)" in shown and "inlined.cu:21" in shown
    # The interpreter's native frame, in a binary only the workload's namespace holds, is named
    # through /proc/PID/root (py-spy alone left it "0x... (?)" and it was taken for user code).
    assert "(?)" not in shown, shown
    named = re.search(r"^\s+(\S+) \(python\)$", shown, re.M)
    assert named, shown
    assert "Process " in shown and "/job/python -m hangwatchd.testing" in shown
    assert "All done" in machine.exec("cat", "/run/workload.log").stdout
    assert "Failed to set up namespace" not in machine.journal()


def test_stop_leaves_no_helper_process_or_temporary_directory(machine: Machine) -> None:
    pid = main_pid(machine)
    helpers = machine.exec("ps", "-o", "pid=", "--ppid", str(pid), check=False).stdout.split()
    assert len(helpers) >= 2  # the symboliser's fork server and multiprocessing's resource tracker
    started = time.monotonic()
    machine.systemctl("stop", UNIT)
    assert time.monotonic() - started < 30
    journal = machine.journal(UNIT)
    assert "SIGKILL" not in journal and "left-over process" not in journal, journal[-2000:]
    assert machine.show("Result")["Result"] == "success"
    assert machine.exec("ls", "-A", "/var/lib/hangwatchd/tmp").stdout.strip() == ""
    assert "daemon_stopping" in [e["event"] for e in machine.daemon_events()]
