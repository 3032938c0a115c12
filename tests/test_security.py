"""The trust boundary, attacked: the daemon runs as root, the attacker as uid 65534 (nobody).

Each attack is made with real files, FIFOs, symlinks and directories in the
daemon's world-writable runtime and dump dirs, by a real unprivileged process.
Each test asserts what a user of the node would see: the daemon stays up, copies
nothing the attacker could not read, files nothing against another user's
process, and a root workload that hangs during the attack is still stored within
its heartbeat timeout + 6 s. Tests that need root skip, saying so, as an ordinary
user; the unit tests of the boundary itself run anywhere.
"""

from __future__ import annotations

import io
import json
import lzma
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard

from hangwatchd.host import untrusted
from hangwatchd.host.user_limits import UserLimits
from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv
from hangwatchd.workload import beat_segment

from .conftest import FIXTURES

NOBODY = 65534
ATTACKER = Path(__file__).with_name("attacker.py")
SYSTEM_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
TIMEOUT = 2.0  # the root workload's heartbeat timeout
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs the daemon as root and the attacker as uid 65534, "
                                                           "which needs root (CI runs as root)")
QUICK = {"pyspy_native": False, "rescan_interval": 1.0}


# -- the boundary itself (any user) ------------------------------------------

def test_untrusted_refuses_links_fifos_directories_and_big_files_without_blocking(tmp_path: Path) -> None:
    me = os.getuid()
    good = tmp_path / "good"
    good.write_bytes(b"x" * 100)
    assert untrusted.read_bytes(good, me, 100) == b"x" * 100
    (tmp_path / "link").symlink_to(good)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    os.link(good, tmp_path / "hard")
    cases = {"link": "symlink", "fifo": "not_regular", "dir": "not_regular", "missing": "missing"}
    start = time.monotonic()
    for name, reason in cases.items():
        with pytest.raises(untrusted.Refused) as err:
            untrusted.read_bytes(tmp_path / name, me, 100)
        assert err.value.reason == reason, name
        assert name in str(err.value)
    assert time.monotonic() - start < 1.0  # the FIFO, with no writer, blocked nothing
    with pytest.raises(untrusted.Refused) as err:
        untrusted.read_bytes(good, me, 99)
    assert err.value.reason == "too_big"
    with pytest.raises(untrusted.Refused) as err:
        untrusted.read_bytes(good, me + 1, 100, allow_root=False)
    assert err.value.reason == "wrong_owner" and f"not uid {me + 1}" in str(err.value)
    # A second link is fine when it is the process's own file, refused when it is someone else's.
    assert untrusted.read_bytes(tmp_path / "hard", me, 100) == b"x" * 100
    with pytest.raises(untrusted.Refused) as err:
        untrusted.read_bytes(tmp_path / "hard", None, 100)
    assert err.value.reason == "hard_link"
    # A FIFO where one is expected opens at once, without a writer.
    fd = untrusted.open_fd(tmp_path / "fifo", me, fifo=True)
    os.close(fd)


def test_a_heartbeat_segment_swapped_for_a_directory_is_refused_not_an_error(tmp_path: Path) -> None:
    seg = tmp_path / "s.beat"
    beat_segment.create(str(seg), os.getpid())
    assert beat_segment.read(str(seg), os.getuid()).count == 0
    seg.unlink()
    seg.mkdir()
    with pytest.raises(untrusted.Refused) as err:
        beat_segment.read(str(seg), os.getuid())
    assert err.value.reason == "not_regular"
    seg.rmdir()
    with pytest.raises(beat_segment.SegmentError):  # gone: the process's business (it may hang), not an attack
        beat_segment.read(str(seg), os.getuid())


def test_process_uid_is_one_uid_or_refused() -> None:
    assert untrusted.process_uid(os.getpid()) == os.getuid()
    with pytest.raises(untrusted.Refused) as err:
        untrusted.process_uid(2**22 + 12345)
    assert err.value.reason == "no_process"


def test_user_limits_bound_a_user_but_never_root() -> None:
    lim = UserLimits(max_registrations=2, samples_per_second=2.0)
    assert lim.over_registrations(1000, [1000]) is None
    assert "max_registrations_per_uid = 2" in (lim.over_registrations(1000, [1000, 1000, 5]) or "")
    assert lim.over_registrations(0, [0] * 100) is None
    taken = sum(1 for i in range(1000) if lim.sample_wait(1000, 10.0 + i * 0.005) == 0.0)  # 5 s of asking
    assert 10 <= taken <= 4 + 2 * 5 + 1  # the burst of 2 s worth, then 2 a second
    assert all(lim.sample_wait(0, 10.0) == 0.0 for _ in range(100))
    assert lim.first("x", 1) and not lim.first("x", 1)


def test_a_dump_is_linked_only_to_a_process_of_its_owner() -> None:
    from hangwatchd.daemon.exception_dumps import attribute
    from hangwatchd.model import ProcessId, Registration

    me, other = os.getuid(), os.getuid() + 1
    claimed = Registration(ProcessId(os.getpid(), 1), uid=me, job="mine")
    assert attribute(me, os.getpid(), claimed).linked
    planted = attribute(other, os.getpid(), claimed)
    assert not planted.linked and planted.registration.uid == other and planted.registration.job is None
    assert planted.registration.process.pid == 0
    assert f"written by uid {other} but names a process that does not run as uid {other}" in (planted.note or "")
    assert str(os.getpid()) not in (planted.note or "") and f"uid {me}" not in (planted.note or "")
    # Unregistered: the live process's own uid decides; a pid that names nothing is the owner's claim.
    assert attribute(me, os.getpid(), None).linked
    assert not attribute(other, os.getpid(), None).linked
    gone = attribute(other, 2**22 + 4321, None)
    assert gone.linked and gone.registration.uid == other


# -- attacks (root daemon, nobody attacker) ------------------------------------

@pytest.fixture
def base() -> Iterator[Path]:
    """A directory the attacker can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="hangwatchd-sec-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Attacker:
    """Processes of uid 65534, stopped (by their process group) at the end of the test."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def run(self, code: str) -> str:
        res = subprocess.run([SYSTEM_PYTHON, "-c", code], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def register(self, runtime_dir: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], list[str]]:
        p = subprocess.Popen([SYSTEM_PYTHON, str(ATTACKER), "register", str(runtime_dir), *args], user=NOBODY,
                             group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True,
                             start_new_session=True, env=env)
        self.procs.append(p)
        line = p.stdout.readline().split()  # type: ignore[union-attr]  # started with a PIPE
        assert line and line[0] == "registered", line
        return p, line[1:]

    def spawn(self, argv: list[str], **kw: object) -> subprocess.Popen[str]:
        p = subprocess.Popen(argv, start_new_session=True, text=True, **kw)  # type: ignore[call-overload]  # **kw holds Popen's own keywords
        self.procs.append(p)
        return p

    def stop(self) -> None:
        stop(*self.procs, sig=signal.SIGKILL, group=True)


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    try:
        yield a
    finally:
        a.stop()


class RootHang:
    """A root workload under ``hangwatchd run`` that beats, then hangs during the attack."""

    def __init__(self, d: ScratchDaemon, job: str = "root-victim", beats: int = 20) -> None:
        self.d, self.job = d, job
        self.proc = d.run(workload_argv(beats=beats, interval=0.05), "--heartbeat-timeout", str(TIMEOUT), "--job", job,
                          stdout=subprocess.PIPE, start_new_session=True)
        self.stopped: list[float] = []  # when it said it stopped beating, noted as the line came
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]  # started with a PIPE
            if b"stopped beating" in line:
                self.stopped.append(time.monotonic())

    def stored_in_time(self) -> dict[str, object]:
        """Wait for it to stop beating, then for its incident: within its timeout + 6 s."""
        stopped = wait_for(lambda: self.stopped, 60, "the root workload's last beat")[0]

        def mine() -> dict[str, object] | None:
            return next((i for i in self.d.store().list() if i["job"] == self.job and i["reason"] == "heartbeat"), None)

        inc = wait_for(mine, TIMEOUT + 30, "the root workload's incident")
        took = time.monotonic() - stopped
        assert took <= TIMEOUT + 6, f"the root workload's hang took {took:.1f} s to be stored during the attack"
        print(f"root hang stored {took:.2f} s after its last beat (timeout {TIMEOUT:g} s)")
        return inc

    def stop(self) -> None:
        stop(self.proc, group=True)


def all_bytes(root: Path) -> Iterator[tuple[Path, bytes]]:
    """Every regular file under root, decompressed where it is a zstd copy."""
    for p in root.rglob("*"):
        if p.is_symlink() or not p.is_file():
            continue
        data = p.read_bytes()
        if p.suffix == ".zst":
            try:
                data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
            except zstandard.ZstdError:
                pass
        yield p, data


def nobody_can_read(path: Path) -> bool:
    code = f"import sys\ntry:\n    open({str(path)!r}, 'rb').read(1)\nexcept PermissionError:\n    sys.exit(3)"
    res = subprocess.run([SYSTEM_PYTHON, "-c", code], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", timeout=30)
    assert res.returncode in (0, 3)
    return res.returncode == 0


def as_nobody_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``hangwatchd ARGS`` as uid 65534: the system's Python (ours may live under root's home)
    with this checkout and its installed dependencies on the path."""
    import sysconfig

    import hangwatchd

    path = os.pathsep.join([str(Path(hangwatchd.__file__).parent.parent), sysconfig.get_paths()["purelib"],
                            sysconfig.get_paths()["platlib"]])
    return subprocess.run([SYSTEM_PYTHON, "-m", "hangwatchd", *args], user=NOBODY, group=NOBODY, extra_groups=[],
                          cwd="/", capture_output=True, text=True, timeout=60, env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"})


def refusals(d: ScratchDaemon, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in d.scrape().splitlines()
               if line.startswith("hangwatchd_registration_errors_total{") and f'reason="{prefix}' in line)


def watched_pids(d: ScratchDaemon) -> set[int]:
    try:
        status = json.loads((d.runtime_dir / "status.json").read_text())
    except (OSError, ValueError):
        return set()
    return {p["pid"] for p in status["processes"]}


def dump_name(pid: int, tag: int = 1) -> str:
    return f"core_{socket.gethostname()}.{pid}.{1700000000 + tag}.nvcudmp"


@needs_root
def test_a_symlink_to_a_root_only_file_renamed_into_the_dump_dir_is_never_copied(base: Path, attacker: Attacker) -> None:
    secret_value = b"ROOT-ONLY-" + os.urandom(8).hex().encode()
    secret = base / "secret"
    secret.write_bytes(secret_value * 100)
    os.chmod(secret, 0o600)
    with ScratchDaemon(base / "d", config=QUICK) as d:
        dumps = d.dump_dir
        victim = RootHang(d)
        try:
            attacker.run(f"""
import os
for i, name in enumerate([{dump_name(4242)!r}, 'nodump_{socket.gethostname()}.4243.1.driver-log']):
    tmp = os.path.join({str(dumps)!r}, '.evil%d' % i)
    os.symlink({str(secret)!r}, tmp)
    os.rename(tmp, os.path.join({str(dumps)!r}, name))
""")
            victim.stored_in_time()
            wait_for(lambda: refusals(d, "dump_symlink") == 2, 10, "both links refused")
            assert d.proc.poll() is None
            assert not [i for i in d.store().list() if i["reason"] == "gpu-exception"]
            leaked = [p for p, data in all_bytes(d.state_dir) if secret_value in data]
            assert leaked == []
            assert secret.read_bytes() == secret_value * 100
        finally:
            victim.stop()


@needs_root
def test_a_planted_driver_log_is_never_filed_against_another_users_job(base: Path, attacker: Attacker) -> None:
    driver_lines = (FIXTURES / "graph_ima" / "stderr.log").read_text()
    with ScratchDaemon(base / "d", config=QUICK) as d:
        dumps = d.dump_dir
        victim = RootHang(d, beats=200)  # it beats on while the exception is filed, then hangs
        try:
            pid = wait_for(lambda: [p for p in watched_pids(d) if p != victim.proc.pid], 10, "the victim's pid")[0]
            # Planted: a "driver wrote no dump" report naming the victim. (Its driver log in the runtime
            # dir cannot be: tests/test_security_fifos.py, no user can take a name in another's.)
            attacker.run(f"""
import os
tmp = os.path.join({str(dumps)!r}, '.evil')
open(tmp, 'w').write({driver_lines!r})
os.rename(tmp, os.path.join({str(dumps)!r}, 'nodump_{socket.gethostname()}.{pid}.1.driver-log'))
""")
            planted = wait_for(lambda: [i for i in d.settled() if i["reason"] == "gpu-exception"], 20, "the planted report")
            assert len(planted) == 1
            inc = planted[0]
            assert inc["processes"] == [] and inc["job"] is None
            assert f"names a process that does not run as uid {NOBODY}: not linked" in inc["summary"]
            # Nothing of it names or counts the victim's process: not the summary, not the log line,
            # not the counter of GPU exceptions filed (it is counted apart, as unattributed).
            assert str(pid) not in inc["summary"]
            stored = d.event("incident_stored", incident=inc["id"])
            assert stored["pids"] == [] and stored["reason"] == "unattributed-dump"
            assert d.metric("hangwatchd_incidents_total", reason="gpu-exception") == 0.0
            assert d.metric("hangwatchd_incidents_total", reason="unattributed-dump") == 1.0
            # Its series exists at 0 from the start (alerts): not counted.
            assert d.metric("hangwatchd_gpu_exceptions_total", type="WARP_ILLEGAL_ADDRESS") == 0.0
            # Filed as the attacker's own: the attacker may read it, and `hangwatchd show` works for them.
            assert nobody_can_read(Path(inc["dir"]) / "incident.json")
            shown = as_nobody_cli("show", str(inc["id"]), "--state-dir", str(d.state_dir))
            assert shown.returncode == 0 and "gpu-exception" in shown.stdout, shown.stderr
            listed = as_nobody_cli("incidents", "--state-dir", str(d.state_dir))
            assert listed.returncode == 0 and str(inc["id"])[:8] in listed.stdout, listed.stderr

            # The real driver (root, the victim's user) writes a dump for the victim: it is the
            # victim's exception, and the planted log is not in it.
            blob = lzma.decompress((FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz").read_bytes())
            tmp = dumps / ".driver-writing"
            tmp.write_bytes(blob)
            tmp.rename(dumps / dump_name(pid))
            real = wait_for(lambda: [i for i in d.settled() if i["reason"] == "gpu-exception" and i["processes"] == [pid]],
                            30, "the real exception")[0]
            assert not (Path(real["dir"]) / str(pid) / "driver.log").exists()
            sym = json.loads((Path(real["dir"]) / str(pid) / "symbolized.json").read_text())
            assert sym["path"] == str(dumps / dump_name(pid))  # read through its fd, named as it came
            assert d.metric("hangwatchd_gpu_exceptions_total", type="WARP_ILLEGAL_ADDRESS") == 1.0
            hang = victim.stored_in_time()
            # A root workload's incidents are root's alone.
            assert not nobody_can_read(Path(str(hang["dir"])) / "incident.json")
            assert not nobody_can_read(Path(real["dir"]) / "incident.json")
            assert driver_lines not in "".join(data.decode("utf-8", "replace") for _, data in all_bytes(Path(real["dir"])))
            assert d.proc.poll() is None
        finally:
            victim.stop()


@needs_root
def test_beat_and_status_files_swapped_after_acceptance_cost_only_that_registration(base: Path, attacker: Attacker) -> None:
    secret = base / "secret.beat"
    beat_segment.create(str(secret), 1, mode=0o600)
    swaps = [("beat", "dir"), ("beat", "fifo"), ("beat", "symlink"), ("status", "dir"), ("status", "fifo"), ("status", "symlink")]
    with ScratchDaemon(base / "d", config=QUICK) as d:
        evil = [attacker.register(d.runtime_dir, "--status", "--timeout", "3") for _ in swaps]
        pids = {int(files[0]) for _, files in evil}
        wait_for(lambda: pids <= watched_pids(d), 15, "the attacker's registrations accepted")
        victim = RootHang(d)
        try:
            for (_, files), (which, kind) in zip(evil, swaps):
                path = files[1] if which == "beat" else files[2]
                make = {"dir": "os.mkdir(p)", "fifo": "os.mkfifo(p)", "symlink": f"os.symlink({str(secret)!r}, p)"}[kind]
                attacker.run(f"import os\np = {path!r}\nos.unlink(p)\n{make}")
            wait_for(lambda: not (pids & watched_pids(d)), 15, "every tampered registration dropped")
            assert refusals(d, "tampered_") == len(swaps)
            victim.stored_in_time()
            d.looked(2, what="rescan")  # two rescans: none comes back while its files stay swapped
            assert not (pids & watched_pids(d))
            assert not [i for i in d.store().list() if set(i["processes"]) & pids]
            assert d.proc.poll() is None
            status = subprocess.run([sys.executable, "-m", "hangwatchd", "status", "--runtime-dir", str(d.runtime_dir)],
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0, status.stderr
        finally:
            victim.stop()
        # Its processes end with their beat files still swapped: the cleanup must not stop the daemon either.
        attacker.stop()
        d.looked(2, what="rescan")  # the daemon went on: it rescanned what the cleanup left, twice
        assert d.proc.poll() is None


@needs_root
def test_fifos_named_like_dumps_block_no_worker_and_sigterm_still_stops_the_daemon(base: Path, attacker: Attacker) -> None:
    with ScratchDaemon(base / "d", config=QUICK) as d:
        dumps = d.dump_dir
        names = [dump_name(5000 + i, i) for i in range(8)] + [f"nodump_{socket.gethostname()}.6000.1.driver-log"]
        attacker.run(f"""
import os
for i, name in enumerate({names!r}):
    tmp = os.path.join({str(dumps)!r}, '.fifo%d' % i)
    os.mkfifo(tmp)
    os.rename(tmp, os.path.join({str(dumps)!r}, name))
tmp = os.path.join({str(dumps)!r}, '.dir')
os.mkdir(tmp)
os.rename(tmp, os.path.join({str(dumps)!r}, {dump_name(7000)!r}))
""")
        victim = RootHang(d)
        try:
            victim.stored_in_time()
            wait_for(lambda: refusals(d, "dump_not_regular") == len(names) + 1, 10, "every FIFO and the directory refused")
            assert not [i for i in d.store().list() if i["reason"] == "gpu-exception"]
        finally:
            victim.stop()
        start = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        assert time.monotonic() - start < 5


@needs_root
def test_a_setuid_process_or_another_users_process_is_never_registered(base: Path, attacker: Attacker) -> None:
    # A setuid program as a user starts it: real uid nobody, effective and saved uid root.
    setuid = attacker.spawn([sys.executable, "-c", f"import os, time\nos.setresuid({NOBODY}, 0, 0)\ntime.sleep(600)"])
    roots = attacker.spawn(["sleep", "600"])
    wait_for(lambda: Path(f"/proc/{setuid.pid}/status").read_text().count(f"{NOBODY}\t0\t0\t0") == 1, 10, "the setuid state")
    with ScratchDaemon(base / "d", config=QUICK) as d:
        own, _ = attacker.register(d.runtime_dir)  # the attacker's own process: that much is allowed
        wait_for(lambda: own.pid in watched_pids(d), 10, "the attacker's own process watched")
        attacker.register(d.runtime_dir, "--pid", str(setuid.pid), "--timeout", "1", "--no-beat")
        attacker.register(d.runtime_dir, "--pid", str(roots.pid), "--timeout", "1", "--no-beat")
        wait_for(lambda: refusals(d, "setuid") == 1 and refusals(d, "wrong_owner") == 1, 10, "both refused")
        victim = RootHang(d)
        try:
            victim.stored_in_time()
            assert not ({setuid.pid, roots.pid} & watched_pids(d))
            assert not [i for i in d.store().list() if {setuid.pid, roots.pid} & set(i["processes"])]
            events = [e for e in d.logs() if e.get("event") == "registration_refused"]
            assert any(e["reason"] == "setuid" and "never acted on for a user" in e["error"] for e in events)
            assert d.proc.poll() is None
        finally:
            victim.stop()


@needs_root
def test_a_registration_flood_stops_at_the_per_user_limit(base: Path, attacker: Attacker) -> None:
    calls = base / "pyspy-calls"
    calls.touch()
    wrapper = base / "py-spy"
    real = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    wrapper.write_text(f"#!/bin/sh\necho \"$(date +%s.%N) $*\" >> {calls}\nexec {real} \"$@\"\n")
    wrapper.chmod(0o755)
    config = dict(QUICK, max_registrations_per_uid=3, pyspy_samples_per_uid=1.0, stack_interval=0.2)
    with ScratchDaemon(base / "d", config=config, env={"HANGWATCHD_PYSPY": str(wrapper)}) as d:
        flood = [attacker.register(d.runtime_dir, "--no-beat-file", "--stack-timeout", "600")[0] for _ in range(8)]
        evil = {p.pid for p in flood}
        wait_for(lambda: refusals(d, "uid_limit") == 5, 15, "five refused at the limit")
        # status.json is written off the loop, at most once a second: the three admitted show there shortly.
        wait_for(lambda: len(evil & watched_pids(d)) == 3, 5, "the three admitted in status.json")
        limited = [e for e in d.logs() if e.get("event") == "registration_refused" and e.get("reason") == "uid_limit"]
        assert len(limited) == 1 and "max_registrations_per_uid = 3" in limited[0]["error"]
        victim = RootHang(d)
        try:
            victim.stored_in_time()
        finally:
            victim.stop()
        # py-spy on the attacker's three processes (wanted 5 a second each): at most 1 a second, after a burst of 2.
        window_start = time.time()
        time.sleep(6)
        window = [line.split() for line in calls.read_text().splitlines()]
        theirs = [w for w in window if float(w[0]) >= window_start and any(str(p) in w for p in evil)]
        assert 3 <= len(theirs) <= 6 + 2 + 1, len(theirs)
        # One of the admitted ends: a waiting one is admitted at the next rescan.
        gone = next(p for p in flood if p.pid in watched_pids(d))
        os.killpg(gone.pid, signal.SIGKILL)
        gone.wait()
        wait_for(lambda: len(evil & watched_pids(d)) == 3 and gone.pid not in watched_pids(d), 10, "a waiting one admitted")
        assert d.proc.poll() is None


@needs_root
def test_fifos_planted_under_the_name_of_a_dump_being_taken_do_not_stand_in_for_it(base: Path, attacker: Attacker) -> None:
    with ScratchDaemon(base / "d", config={"gpu_dump": "always", "pyspy_native": False}) as d:
        dumps = d.dump_dir
        work = d.run([sys.executable, "-m", "hangwatchd.testing", "gpu-workload", "--beats", "40",
                      "--dump", str(FIXTURES / "cpp_hang" / "coredump.nvcudmp.xz")],
                     "--heartbeat-timeout", "1", "--rank", "0", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                     start_new_session=True)
        try:
            pid = wait_for(lambda: list(watched_pids(d)), 10, "the workload's pid")[0]
            # Until stopped: a new FIFO under the name the driver will use for this pid, every 20 ms.
            attacker.spawn([SYSTEM_PYTHON, "-c", f"""
import os, time
for n in range(3000):
    tmp = os.path.join({str(dumps)!r}, '.f%d' % n)
    os.mkfifo(tmp)
    os.rename(tmp, os.path.join({str(dumps)!r}, {f"core_{socket.gethostname()}.{pid}."!r} + str(n) + '.nvcudmp'))
    time.sleep(0.02)
"""], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/")
            assert b"stopped beating" in work.stdout.readline()  # type: ignore[union-attr]  # started with a PIPE
            stopped = time.monotonic()
            inc = wait_for(lambda: next((i for i in d.settled() if i["reason"] == "heartbeat"), None), 60, "the incident")
            data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
            steps = {s["step"]: s for s in data["processes"][0]["steps"]}
            assert steps["cuda_dump"]["ok"], steps["cuda_dump"]
            assert (Path(inc["dir"]) / str(pid) / "symbolized.json").exists()
            assert time.monotonic() - stopped <= 1 + 6
            assert d.proc.poll() is None
        finally:
            if work.poll() is None:
                os.killpg(work.pid, signal.SIGKILL)
            work.wait()
            work.stdout.close()  # type: ignore[union-attr]  # started with a PIPE


def test_the_per_user_limits_are_validated(tmp_path: Path) -> None:
    from hangwatchd import config

    for key, bad in (("max_registrations_per_uid", 0), ("max_registrations_per_uid", 2.5), ("pyspy_samples_per_uid", -1)):
        cfg = tmp_path / "c.toml"
        cfg.write_text(f"{key} = {bad}\n")
        with pytest.raises(config.ConfigError) as err:
            config.load(cfg)
        assert key in str(err.value) and "greater than 0" in str(err.value)
    cfg.write_text("max_registrations_per_uid = 8\npyspy_samples_per_uid = 0.5\n")
    loaded = config.load(cfg)
    assert (loaded.max_registrations_per_uid, loaded.pyspy_samples_per_uid) == (8, 0.5)
