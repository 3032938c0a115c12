"""The stack probe (detect/stack_probe.py), attacked: its helper runs as root and opens the files a
watched process's interpreter is mapped from, by the names /proc gives (pystack reads their
symbols), and the debug files named beside them. A user names those: a binary deleted after its
exec is ``PATH (deleted)``, a name the user may then create, as a symlink to a file of root's or a
FIFO. py-spy, as root, opens ``/proc/PID/exe`` alone and is not led anywhere.

The daemon runs as root, the attacker as uid 65534 (nobody), with real files, a real copy of the
system's Python, real pystack and py-spy. Tests that need root skip, saying so, as an ordinary user.
"""

from __future__ import annotations

import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from inotify_simple import INotify, flags

from hangwatchd.detect.sampler import Sampler
from hangwatchd.detect.stack_probe import StackProbe
from hangwatchd.host import procfs
from hangwatchd.host.pyspy_binary import find_pyspy
from hangwatchd.host.user_limits import UserLimits
from hangwatchd.model import Registration
from hangwatchd.testing import ScratchDaemon, stop, wait_for

from .test_security import ATTACKER, NOBODY, SYSTEM_PYTHON

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="runs the daemon as root and the attacker as uid 65534, which needs root"),
    pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed"),
]
try:
    import pystack  # noqa: F401 - only whether the probe can read here
except ImportError:
    pytestmark.append(pytest.mark.skip(reason="pystack is not installed (the probe is off)"))

# As nobody: run a copy of the system's Python from the attacker's directory, registered to be
# watched by its stack (it wakes every 0.1 s, so each sample is probed), then delete that copy and
# put a name of the attacker's choosing where /proc now says the binary is: "DIR/python3 (deleted)".
PLANT = """
import os, shutil, subprocess, sys
d, python, attacker, runtime, target, kind = sys.argv[1:7]
mine = os.path.join(d, "python3")
shutil.copy(python, mine)
p = subprocess.Popen([mine, attacker, "register", runtime, "--no-beat-file", "--stack-timeout", "60", "--no-beat"],
                     stdout=subprocess.PIPE, text=True)
print(p.stdout.readline().strip(), flush=True)
os.unlink(mine)
planted = mine + " (deleted)"
if kind == "symlink":
    os.symlink(target, planted)
else:
    os.mkfifo(planted)
print("planted", planted, flush=True)
p.wait()
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory the attacker can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="hangwatchd-probe-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _plant(base: Path, d: ScratchDaemon, target: Path, kind: str) -> tuple[subprocess.Popen[str], int]:
    mine = base / "attacker"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    p = subprocess.Popen([SYSTEM_PYTHON, "-c", PLANT, str(mine), os.path.realpath(SYSTEM_PYTHON), str(ATTACKER),
                          str(d.runtime_dir), str(target), kind],
                         user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout is not None
    registered = p.stdout.readline().split()
    assert registered and registered[0] == "registered", registered
    assert p.stdout.readline().startswith("planted"), "the attacker could not plant its name"
    return p, int(registered[1])


def _sampled(d: ScratchDaemon, times: int) -> None:
    """Wait for ``times`` more stack samples (the attacker's process is the only one watched)."""
    start = d.metric_total("hangwatchd_stack_samples_total")
    wait_for(lambda: d.metric_total("hangwatchd_stack_samples_total") >= start + times or None, 60,
             f"{times} more stack samples", every=0.2)


def test_a_deleted_interpreter_never_leads_the_root_probe_to_a_file_the_user_names(base: Path) -> None:
    vault = base / "vault"  # root's alone
    vault.mkdir(mode=0o700)
    secret = vault / "secret"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    watch = INotify()
    watch.add_watch(str(secret), flags.OPEN)
    with ScratchDaemon(base / "d", config={"stack_interval": 0.5, "pyspy_native": False, "gpu_dump": "never"}) as d:
        p, pid = _plant(base, d, secret, "symlink")
        try:
            _sampled(d, 6)
            opened = watch.read(timeout=0)
            assert not opened, f"root opened {secret} through the attacker's '(deleted)' symlink {len(opened)} times"
            assert Path(f"/proc/{pid}").exists()  # it was watched all along
        finally:
            stop(p, sig=signal.SIGKILL, group=True)
            watch.close()


def test_a_users_process_is_still_read_by_the_probe_with_that_users_rights(base: Path) -> None:
    """The probe's rights to open files are its target's user's: enough to read that user's Python."""

    p = subprocess.Popen([SYSTEM_PYTHON, "-c", "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)"],
                         user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    probe = StackProbe()
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        got = probe.probe(p.pid, time.monotonic() + 10)
        assert got is not None and probe.failures == 0, "the probe could not read a process of nobody's"
    finally:
        probe.close()
        stop(p, sig=signal.SIGKILL, group=True)


# As nobody: the same copy, run, deleted, and a FIFO of its own planted as "DIR/python3 (deleted)":
# a probe of it, with the user's rights, opens that FIFO and waits for a writer until its deadline.
STALL = """
import os, shutil, subprocess, sys, time
d, python = sys.argv[1:3]
mine = os.path.join(d, "python3")
shutil.copy(python, mine)
p = subprocess.Popen([mine, "-c", "import time\\nwhile True: time.sleep(0.05)"])
time.sleep(0.3)
os.unlink(mine)
os.mkfifo(mine + " (deleted)")
print(p.pid, flush=True)
p.wait()
"""


def test_one_users_stalling_process_never_stops_the_probe_for_another_users(base: Path) -> None:
    """Each probe of the staller is cut at its deadline and the helper killed; past six kills in a
    minute the probe rested for everyone. The staller's user alone is left to py-spy."""
    from .test_stack_probe import STILL, _reg, _round, _spawn

    mine = base / "attacker"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    staller = subprocess.Popen([SYSTEM_PYTHON, "-c", STALL, str(mine), os.path.realpath(SYSTEM_PYTHON)], user=NOBODY,
                               group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    victim = _spawn(STILL)
    inbox: queue.Queue[object] = queue.Queue()
    sampler = Sampler(1.0, 100.0, UserLimits(100, 100.0), inbox.put)
    try:
        assert staller.stdout is not None
        pid = int(staller.stdout.readline())
        bad = _reg_of(pid)
        samples = _round(sampler, inbox, [bad])
        for _ in range(8):  # as many samples as a minute of stack_interval = 7.5 s gives
            time.sleep(0.3)  # it ran since: the probe is asked first
            samples = _round(sampler, inbox, [bad], samples)
            assert samples[pid].read and samples[pid].error is None  # py-spy reads it (from /proc/PID/exe)
        good = _reg(victim)
        samples = _round(sampler, inbox, [good])
        carried = []
        for _ in range(3):  # a probe that finds it awake (its 0.2 s sleep just ended) counts for nothing: three chances
            time.sleep(0.3)  # it ran since: only the probe can carry it
            samples = _round(sampler, inbox, [good], samples)
            carried.append(samples[victim.pid].probed and not samples[victim.pid].read)
        assert any(carried), "the probe was off for another user's process after one user's stalls"
        assert sampler.probe.failures <= 2, f"the helper was killed {sampler.probe.failures} times by one user's process"
    finally:
        sampler.shutdown()
        stop(staller, victim, sig=signal.SIGKILL, group=True)


def _reg_of(pid: int) -> Registration:
    me, uid = procfs.identify(pid), procfs.uid(pid)
    assert me is not None and uid == NOBODY
    return Registration(process=me, uid=uid, beat_file=None)


# Each moves one local between two reads and nothing else: a name rebound to a new long string that
# differs after its first 80 characters (a long URL's or a path's last part: pystack's repr stops
# there), and to a new int past 2**63 (pystack reads none: "<UNRESOLVED BIG INT>"). py-spy's digest
# has each value's address, and moves: every value is kept, so each new one has an address of its own.
MOVES_UNSEEN = {
    "long string": "prefix, seen = 'https://storage.example.com/' + 'bucket/' * 12, [''] * 20",
    "big int": "prefix, seen = 2**63, [0] * 20",
}
LOOP = "while True:\n        url = prefix + type(prefix)(len(seen))\n        seen.append(url)\n        time.sleep(0.05)"


@pytest.mark.parametrize("what", sorted(MOVES_UNSEEN))
def test_the_probe_never_says_same_where_py_spy_reads_a_move(what: str) -> None:
    """A probe's "same" carries py-spy's last sample forward: where it says so of a process that
    moved, a loop that makes progress looks frozen, and is paged as hung after its window."""
    from hangwatchd.detect.stack import take_sample

    code = f"import time\ndef work():\n    {MOVES_UNSEEN[what]}\n    print('ready', flush=True)\n    {LOOP}\nwork()\n"
    p = subprocess.Popen([SYSTEM_PYTHON, "-c", code], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    probe = StackProbe()
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        a, first = probe.probe(p.pid, time.monotonic() + 10, NOBODY), take_sample(p.pid, 10.0)
        time.sleep(0.4)
        b, second = probe.probe(p.pid, time.monotonic() + 10, NOBODY), take_sample(p.pid, 10.0)
        assert first.error is None and second.error is None
        assert (first.signature, first.locals_digest) != (second.signature, second.locals_digest), "py-spy saw it move"
        assert a is None or b is None or a.state != b.state, f"the probe said 'same' of a {what} that moved"
    finally:
        probe.close()
        stop(p, sig=signal.SIGKILL, group=True)


# As nobody: a stack 5,000 Python frames deep; pystack, reading it, overflows the helper's stack
# (SIGSEGV). The helper holds what it read of every user's process: it must not dump it as a core.
DEEP = """
import sys, time
sys.setrecursionlimit(100_000)
def down(n):
    if n:
        return down(n - 1)
    print('ready', flush=True)
    while True:
        time.sleep(0.05)
down(5000)
"""


def test_a_user_who_crashes_the_helper_gets_no_core_of_it_written_and_others_are_still_probed() -> None:
    p = subprocess.Popen([SYSTEM_PYTHON, "-c", DEEP], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))  # as a daemon started where cores are kept
    other = _spawn_root()
    probe = StackProbe()
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert probe.probe(other.pid, time.monotonic() + 10) is not None  # started, and reads root's
        assert probe._proc is not None
        limits = Path(f"/proc/{probe._proc.pid}/limits").read_text()
        core = next(line for line in limits.splitlines() if line.startswith("Max core file size"))
        assert core.split()[4] == "0", f"the root helper may dump core: {core}"
        assert probe.probe(p.pid, time.monotonic() + 10, NOBODY) is None and probe.failures == 1  # it crashed
        assert probe.probe(p.pid, time.monotonic() + 10, NOBODY) is None and probe.failures == 1  # not asked again
        assert probe.probe(other.pid, time.monotonic() + 10) is not None  # the others' are read
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
        probe.close()
        stop(p, other, sig=signal.SIGKILL, group=True)


def _spawn_root() -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)"],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p
