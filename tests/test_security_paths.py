"""The trust boundary over time and across users: paths, liveness, jobs, the lock, setuid.

The daemon runs as root, the attacker as uid 65534 (nobody), and where a user's job is
the victim, as a second ordinary uid. Each attack is made with real files, links,
sockets and processes in the daemon's runtime dir, the way a hostile local user would
make it. Each test asserts what a user of the node would see: nothing of root's is read
or deleted, no hang is hidden or made up, another user's processes never join a job,
the daemon restarts, and a root workload that hangs during the attack is still stored
within its heartbeat timeout + 10 s. As an ordinary user these tests skip, saying so;
the unit tests of the boundary itself run anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

import hangwatchd
from hangwatchd.host import untrusted
from hangwatchd.model import ProcessId
from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv
from hangwatchd.workload import exits
from tests.s3server import S3Server

from .test_security import NOBODY, QUICK, SYSTEM_PYTHON, TIMEOUT, Attacker, RootHang, all_bytes, attacker, base, needs_root, refusals, watched_pids  # noqa: F401 - fixtures (base, attacker) and names the tests below use

VICTIM = 4243  # a second ordinary user, whose job the attacker goes after
SLACK = 10.0  # a hang during an attack is stored within its timeout + this


def within(stopped: float, took_from: float) -> float:
    took = took_from - stopped
    assert took <= TIMEOUT + SLACK, f"the hang took {took:.1f} s to be stored during the attack"
    print(f"hang stored {took:.2f} s after its last beat (timeout {TIMEOUT:g} s)")
    return took


class Hang(RootHang):
    """RootHang, held to timeout + 10 s (the bound the security model promises under attack)."""

    def stored_in_time(self) -> dict[str, object]:
        stopped = wait_for(lambda: self.stopped, 60, "the root workload's last beat")[0]
        inc = wait_for(lambda: next((i for i in self.d.store().list() if i["job"] == self.job
                                     and i["reason"] == "heartbeat"), None),
                       TIMEOUT + 30, "the root workload's incident")
        within(stopped, time.monotonic())
        return inc


def outcome(d: ScratchDaemon, pid: int, reason: str) -> str:
    """Wait until the daemon has judged the attacker's registration: 'watched' or 'refused'."""
    return wait_for(lambda: "watched" if pid in watched_pids(d) else ("refused" if refusals(d, reason) else None),
                    15, "the attacker's registration judged")


def forgotten(d: ScratchDaemon, pid: int) -> bool:
    return any(e.get("event") == "process_forgotten" and e.get("pid") == pid for e in d.logs())


def user_env() -> dict[str, str]:
    """What another user needs to run this checkout's hangwatchd with the system's Python."""
    path = os.pathsep.join([str(Path(hangwatchd.__file__).parent.parent), sysconfig.get_paths()["purelib"],
                            sysconfig.get_paths()["platlib"]])
    return {"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "HOME": "/"}


def run_as(attacker: Attacker, uid: int, d: ScratchDaemon, job: str, timeout: float, beats: int,
           **kw: object) -> subprocess.Popen[str]:
    """``hangwatchd run --job JOB`` of a beating workload, as ``uid``, with the system's Python."""
    return attacker.spawn([SYSTEM_PYTHON, "-m", "hangwatchd", "run", "--runtime-dir", str(d.runtime_dir), "--job", job,
                           "--heartbeat-timeout", str(timeout), "--", SYSTEM_PYTHON, *workload_argv(beats=beats)[1:]],
                          user=uid, group=uid, extra_groups=[], cwd="/", env=user_env(), **kw)


# -- the boundary itself (any user) ------------------------------------------

def test_a_user_named_path_resolves_once_to_a_plain_name_in_the_trusted_dir(tmp_path: Path) -> None:
    beats = tmp_path / "beats"
    beats.mkdir()
    (beats / "sub").mkdir()
    (beats / "mine.beat").write_bytes(b"x" * 64)
    (beats / "LINK").symlink_to(".")
    dir_fd = untrusted.open_dir(beats)
    try:
        me = os.getuid()
        f = untrusted.resolve_in(dir_fd, beats, str(beats / "mine.beat"), me)
        assert f.name == "mine.beat" and f.read_bytes(64) == b"x" * 64
        # Any other spelling that leads to the same file: a link or '..' on the way, another dir.
        for named in (beats / "LINK" / "mine.beat", f"{beats}/sub/../mine.beat", beats / "sub" / "mine.beat",
                      tmp_path / "mine.beat", "mine.beat", f"{beats}/", f"{beats}/.."):
            with pytest.raises(untrusted.Refused) as err:
                untrusted.resolve_in(dir_fd, beats, str(named), me)
            assert err.value.reason == "outside_dir", named
        # Resolved once: the file moving away and a link put under its name is refused, not followed.
        (beats / "mine.beat").rename(tmp_path / "moved")
        (beats / "mine.beat").symlink_to(tmp_path / "moved")
        with pytest.raises(untrusted.Refused) as err:
            f.read_bytes(64)
        assert err.value.reason == "symlink"
        assert not f.unlink() and (tmp_path / "moved").exists()  # not the file accepted: left alone
        (beats / "mine.beat").unlink()
        (beats / "mine.beat").write_bytes(b"y")
        assert not f.unlink() and (beats / "mine.beat").exists()  # same name, another file
        g = untrusted.resolve_in(dir_fd, beats, str(beats / "mine.beat"), me)
        assert g.unlink() and not (beats / "mine.beat").exists()
        # Someone else's file (or root's, for a user) is never accepted as the user's.
        with pytest.raises(untrusted.Refused) as err:
            untrusted.resolve_in(dir_fd, beats, str(beats / "sub"), me)
        assert err.value.reason == "not_regular"
        (beats / "theirs").write_bytes(b"z")
        with pytest.raises(untrusted.Refused) as err:
            untrusted.resolve_in(dir_fd, beats, str(beats / "theirs"), me + 1)
        assert err.value.reason == "wrong_owner"
        missing = untrusted.resolve_in(dir_fd, beats, str(beats / "later.status"), me, must_exist=False)
        assert missing.inode is None and not missing.unlink()
    finally:
        os.close(dir_fd)


def test_a_dump_dir_the_workload_names_is_held_as_a_descriptor_for_the_whole_wait(tmp_path: Path) -> None:
    from hangwatchd.capture.waitfile import Watch

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "trace0").write_bytes(b"elsewhere")
    (tmp_path / "L").symlink_to("a")
    watch = Watch(tmp_path / "L", "trace*", os.getuid())
    try:
        # The named directory now leads elsewhere, to a file of the same name.
        (tmp_path / "L").unlink()
        (tmp_path / "L").symlink_to("b")
        (tmp_path / "a" / "trace0").write_bytes(b"the trace")
        found = wait_for(lambda: watch.wait(0.5), 10, "the trace")
        fd = watch.open(found, os.getuid(), 1024)
        try:
            assert os.pread(fd, 100, 0) == b"the trace"
            assert watch.unlink_same(found, os.fstat(fd))
        finally:
            os.close(fd)
        assert not (tmp_path / "a" / "trace0").exists() and (tmp_path / "b" / "trace0").read_bytes() == b"elsewhere"
    finally:
        watch.close()


def test_deeply_nested_json_from_a_user_is_a_refusal_not_a_recursion_error() -> None:
    assert untrusted.json_object(b'{"a": "[[[[[[[[[[{{{{", "b": [1, [2, {"c": 3}]]}', 8)["b"] == [1, [2, {"c": 3}]]
    for raw in (b"[" * 4000, b'{"a":' + b"[" * 100_000, b'{"a": [[[[[[[[[1]]]]]]]]]}'):
        with pytest.raises(untrusted.Refused) as err:
            untrusted.json_object(raw, 8)
        assert err.value.reason == "bad_json" and "nested more than 8 deep" in str(err.value)
    with pytest.raises(untrusted.Refused):
        untrusted.json_object(b"[1, 2]", 8)


def test_an_exit_record_of_another_user_never_joins_a_job(tmp_path: Path) -> None:
    from hangwatchd.model import Registration

    (tmp_path / exits.DIR).mkdir()
    mine = Registration(ProcessId(10, 1), uid=os.getuid(), job="train")
    theirs = Registration(ProcessId(11, 1), uid=os.getuid() + 1, job="train")
    gone = exits.Departures(tmp_path, keep=600)
    for r in (mine, theirs):
        gone.add(exits.Departed(r, time.time(), None, 0))
    assert [d.registration for d in gone.of_job(mine)] == [mine]
    assert [d.registration for d in gone.of_job(theirs)] == [theirs]
    # A record nested deeper than any of ours is no record, and no error.
    (tmp_path / exits.DIR / exits.file_name(mine.process)).write_bytes(b"[" * 4000)
    assert exits.read(tmp_path, mine.process, os.getuid()) is None
    assert gone.of_job(mine)[0].exit is None


def test_the_notify_proxy_counts_only_what_the_workload_itself_sends(tmp_path: Path) -> None:
    from hangwatchd.host import procfs
    from hangwatchd.workload import beat_segment
    from hangwatchd.workload.launcher import NotifyProxy

    beat = tmp_path / "run-x.beat"
    beat_segment.create(str(beat), 0)
    proxy = NotifyProxy(tmp_path / "run-x", beat, None)
    send = ("import socket, sys\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\nsys.stdin.readline()\n"
            "s.sendto(b'WATCHDOG=1\\nSTATUS=mine', sys.argv[1])\nprint('sent', flush=True)\nsys.stdin.readline()")
    # The workload, and a process started beside it (same user, alive, not below it).
    work = subprocess.Popen([sys.executable, "-c", send, str(proxy.address)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    beside = subprocess.Popen([sys.executable, "-c", send.replace("mine", "not mine"), str(proxy.address)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proxy.workload, proxy.workload_uid = procfs.identify(work.pid), os.getuid()
        proxy.start()
        for p in (beside, work):
            p.stdin.write("go\n")  # type: ignore[union-attr]  # started with a PIPE
            p.stdin.flush()  # type: ignore[union-attr]  # started with a PIPE
            assert p.stdout.readline().strip() == "sent"  # type: ignore[union-attr]  # started with a PIPE
            wanted = 1 if p is beside else 2
            wait_for(lambda: proxy.dropped + beat_segment.read(str(beat)).count >= wanted, 10, "the datagram read")  # noqa: B023 - waited for here
        assert proxy.dropped == 1
        assert beat_segment.read(str(beat)).count == 1
        wait_for(proxy.status_file.exists, 10, "the workload's STATUS= kept")  # written just after the beat
        assert proxy.status_file.read_text() == "mine"
    finally:
        stop(work, beside)
        proxy.close()


# -- attacks (root daemon, nobody attacker) ------------------------------------

@needs_root
def test_a_status_file_named_through_a_directory_link_never_leaks_a_root_file(base: Path, attacker: Attacker) -> None:
    secret_value = b"ROOT-ONLY-" + os.urandom(8).hex().encode()
    private = base / "private"
    private.mkdir(mode=0o700)
    (private / "secret").write_bytes(secret_value)
    os.chmod(private / "secret", 0o600)
    with ScratchDaemon(base / "d", config=QUICK) as d:
        beats = d.runtime_dir / "beats"
        # LINK -> "." passes any check of where the path leads; the file there is the attacker's own.
        attacker.run(f"import os\nos.symlink('.', {str(beats / 'LINK')!r})\nopen({str(beats / 'secret')!r}, 'w').write('mine')")
        evil, _ = attacker.register(d.runtime_dir, "--status-path", str(beats / "LINK" / "secret"), "--timeout", "3")
        judged = outcome(d, evil.pid, "bad_beat_file")
        # Accepted or not, LINK now points at a directory only root may enter; and the attacker's
        # process stops beating, so that its "status" also goes into an incident.
        attacker.run(f"import os\nos.unlink({str(beats / 'LINK')!r})\nos.symlink({str(private)!r}, {str(beats / 'LINK')!r})")
        os.kill(evil.pid, signal.SIGSTOP)
        victim = Hang(d)
        try:
            victim.stored_in_time()  # several seconds: status.json is rewritten many times meanwhile
            if judged == "watched":  # the attacker's own hang, with its "status", is an incident too
                wait_for(lambda: [i for i in d.store().list() if evil.pid in i["processes"]], 20, "the attacker's incident")
            leaked = [str(p) for root in (d.state_dir, d.runtime_dir) for p, data in all_bytes(root) if secret_value in data]
            assert leaked == []
            assert judged == "refused"
            refused = [e for e in d.logs() if e.get("event") == "registration_refused" and e.get("reason") == "bad_beat_file"]
            assert any("is not a file directly in" in e["error"] for e in refused)
            assert d.proc.poll() is None
        finally:
            victim.stop()


@needs_root
def test_a_beat_file_named_through_a_directory_later_linked_elsewhere_deletes_nothing_there(base: Path, attacker: Attacker) -> None:
    target = base / "target"
    (target / "sub").mkdir(parents=True)
    precious = target / "NAME"
    precious.write_bytes(b"root's own")
    with ScratchDaemon(base / "d", config=QUICK) as d:
        beats = d.runtime_dir / "beats"
        attacker.run(f"import os\nos.mkdir({str(beats / 'DIR')!r})")
        evil, _ = attacker.register(d.runtime_dir, "--beat-path", f"{beats}/DIR/../NAME", "--timeout", "30")
        judged = outcome(d, evil.pid, "bad_beat_file")
        attacker.run(f"import os\nos.rmdir({str(beats / 'DIR')!r})\nos.symlink({str(target / 'sub')!r}, {str(beats / 'DIR')!r})")
        victim = Hang(d)
        try:
            os.killpg(evil.pid, signal.SIGKILL)  # its exit is when the daemon cleans up after it
            evil.wait()
            if judged == "watched":
                wait_for(lambda: forgotten(d, evil.pid), 15, "the attacker's exit seen")
            victim.stored_in_time()
            assert precious.read_bytes() == b"root's own"
            assert judged == "refused"
            assert d.proc.poll() is None
        finally:
            victim.stop()


@needs_root
def test_a_registration_naming_roots_beat_file_is_refused_and_roots_job_keeps_its_segment(base: Path, attacker: Attacker) -> None:
    with ScratchDaemon(base / "d", config=QUICK) as d:
        victim = Hang(d, beats=200)  # beats for 10 s, then hangs
        try:
            root_beat = wait_for(lambda: [p for p in (d.runtime_dir / "beats").glob("run-*.beat") if p.stat().st_uid == 0],
                                 10, "root's beat segment")[0]
            evil, _ = attacker.register(d.runtime_dir, "--beat-path", str(root_beat), "--timeout", "30")
            judged = outcome(d, evil.pid, "bad_beat_file")
            os.killpg(evil.pid, signal.SIGKILL)
            evil.wait()
            if judged == "watched":
                wait_for(lambda: forgotten(d, evil.pid), 15, "the attacker's exit seen")
            assert root_beat.exists(), "the daemon deleted root's beat segment for the attacker"
            inc = victim.stored_in_time()
            # Root's only incident is its real hang, after its last beat (no false one before).
            mine = [i for i in d.store().list() if i["job"] == victim.job]
            assert [i["id"] for i in mine] == [inc["id"]]
            assert judged == "refused"
            events = [e for e in d.logs() if e.get("event") == "registration_refused" and e.get("reason") == "bad_beat_file"]
            assert any("belongs to uid 0, not uid 65534" in e["error"] for e in events)
        finally:
            victim.stop()


NOTIFY_WORKLOAD = """
import os, signal, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
addr = os.environ["NOTIFY_SOCKET"]
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
s.sendto(b"READY=1\\nSTATUS=working", addr)
while not stop:
    s.sendto(b"WATCHDOG=1", addr)
    time.sleep(0.05)
s.sendto(b"STATUS=stopped beating", addr)
print("stopped beating", flush=True)
time.sleep(600)
"""


@needs_root
def test_notify_datagrams_from_another_user_neither_keep_a_job_alive_nor_reach_systemd(base: Path, attacker: Attacker) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    upstream.bind(str(base / "systemd.notify"))  # the unit's NOTIFY_SOCKET around hangwatchd run
    got: list[bytes] = []
    def listen() -> None:
        while True:
            got.append(upstream.recv(4096))

    threading.Thread(target=listen, daemon=True).start()
    evil_status = "EVIL-" + os.urandom(4).hex()
    with ScratchDaemon(base / "d", config=QUICK) as d:
        work = d.run([sys.executable, "-c", NOTIFY_WORKLOAD], "--heartbeat-timeout", str(TIMEOUT), "--job", "notified",
                     stdout=subprocess.PIPE, start_new_session=True, env=dict(os.environ, NOTIFY_SOCKET=str(base / "systemd.notify")))
        try:
            wait_for(lambda: b"STATUS=working" in b"\n".join(got), 15, "the workload's own STATUS= passed on")
            pid = wait_for(lambda: [p for p in watched_pids(d) if p != work.pid], 10, "the workload watched")[0]
            spam = attacker.spawn([SYSTEM_PYTHON, "-c", f"""
import glob, socket, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sent = 0
while True:
    for p in glob.glob({str(d.runtime_dir / 'beats' / '*.notify')!r}):
        try:
            s.sendto(b"WATCHDOG=1\\nSTATUS={evil_status}\\nWATCHDOG=trigger", p)
            sent += 1
        except OSError:
            pass
    if sent == 50:
        print("sent", flush=True)
    time.sleep(0.01)
"""], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE)
            assert spam.stdout.readline().strip() == "sent"  # type: ignore[union-attr]  # started with a PIPE
            os.kill(work.pid, signal.SIGUSR1)  # hangwatchd run passes it on: the workload stops beating
            assert b"stopped beating" in work.stdout.readline()  # type: ignore[union-attr]  # started with a PIPE
            stopped = time.monotonic()
            inc = wait_for(lambda: next((i for i in d.store().list() if i["job"] == "notified"), None), TIMEOUT + 30,
                           "the workload's incident while another user pings for it")
            within(stopped, time.monotonic())
            assert inc["reason"] == "heartbeat" and inc["processes"] == [pid]
            data = json.loads((Path(str(inc["dir"])) / "incident.json").read_text())
            assert data["notify_status"] == "stopped beating"
            wait_for(lambda: b"STATUS=stopped beating" in got, 10, "the workload's last STATUS= passed on")
            assert not [g for g in got if b"trigger" in g or evil_status.encode() in g], got
            status = (d.runtime_dir / "status.json").read_text()
            assert evil_status not in status and evil_status not in json.dumps(data)
            assert d.proc.poll() is None
        finally:
            stop(work, group=True)
            upstream.close()


@needs_root
def test_another_users_process_under_the_same_job_name_never_joins_the_job(base: Path, attacker: Attacker) -> None:
    job = "victims-job"
    with ScratchDaemon(base / "d", config=QUICK) as d:
        victim = run_as(attacker, VICTIM, d, job, TIMEOUT, 300, stdout=subprocess.PIPE)
        stopped: list[float] = []

        def read() -> None:
            for line in victim.stdout:  # type: ignore[union-attr]  # started with a PIPE
                if "stopped beating" in line:
                    stopped.append(time.monotonic())

        threading.Thread(target=read, daemon=True).start()
        vpid = wait_for(lambda: [p for p in watched_pids(d) if p != victim.pid], 15, "the victim's workload watched")[0]
        # One fake rank alive and beating, two that exit leaving records: one nested 4000 deep, one believable.
        alive, _ = attacker.register(d.runtime_dir, "--job", job, "--timeout", "30")
        nested, _ = attacker.register(d.runtime_dir, "--job", job, "--timeout", "30")
        lying, _ = attacker.register(d.runtime_dir, "--job", job, "--timeout", "30")
        evil = {alive.pid, nested.pid, lying.pid}
        wait_for(lambda: evil <= watched_pids(d), 15, "the attacker's processes watched")
        for p, record in ((nested, '"[" * 4000'), (lying, '{"pid": PID, "start_time": START, "status": 1, "signal": None, '
                                                           '"time": time.time()}')):
            start = int(Path(f"/proc/{p.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19])
            name = exits.file_name(ProcessId(p.pid, start))
            record = record.replace("PID", str(p.pid)).replace("START", str(start))
            attacker.run(f"import json, time\nr = {record}\nopen({str(d.runtime_dir / 'exits' / name)!r}, 'w')"
                         f".write(r if isinstance(r, str) else json.dumps(r))")
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        wait_for(lambda: forgotten(d, nested.pid) and forgotten(d, lying.pid), 15, "the fake ranks' exits seen")
        root = Hang(d)
        try:
            root.stored_in_time()
            last = wait_for(lambda: stopped, 60, "the victim's last beat")[0]
            inc = wait_for(lambda: next((i for i in d.store().list() if i["job"] == job), None), TIMEOUT + 30,
                           "the victim's incident")
            within(last, time.monotonic())
            assert inc["processes"] == [vpid]
            incdir = Path(str(inc["dir"]))
            assert sorted(p.name for p in incdir.iterdir() if p.is_dir()) == [str(vpid)]
            text = "".join(data.decode("utf-8", "replace") for _, data in all_bytes(incdir))
            assert not [p for p in evil if f'"pid": {p}' in text]
            assert alive.pid in watched_pids(d)  # the fake rank is its own user's business, untouched
            assert not [e for e in d.logs() if e.get("event") == "loop_error"]
            assert d.proc.poll() is None
        finally:
            root.stop()
            stop(victim, group=True)


@needs_root
def test_a_user_holding_daemon_lock_files_cannot_keep_the_daemon_from_restarting(base: Path, attacker: Attacker) -> None:
    d = ScratchDaemon(base / "d", config=QUICK)
    run = d.runtime_dir
    try:
        # Every daemon.lock the attacker can open, held and flocked the moment the daemon lets go.
        holder = attacker.spawn([SYSTEM_PYTHON, "-c", f"""
import fcntl, glob, os, time
held = []
for p in set(glob.glob({str(run)!r} + '/**/daemon.lock', recursive=True) + [{str(run / 'daemon.lock')!r}]):
    try:
        held.append(os.open(p, os.O_RDONLY))
    except OSError:
        pass
print(len(held), flush=True)
while True:
    for fd in held:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
    time.sleep(0.01)
"""], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE)
        opened = int(holder.stdout.readline())  # type: ignore[union-attr]  # started with a PIPE
    finally:
        assert d.stop() == 0
    d = ScratchDaemon(base / "d", config=QUICK)  # raises, with the daemon's log, when it cannot start
    try:
        assert opened == 0, "the attacker could open the daemon's lock"
        second = subprocess.run([sys.executable, "-m", "hangwatchd", "daemon", "--state-dir", str(d.state_dir),
                                 "--runtime-dir", str(run), "--metrics-address", "127.0.0.1:0"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1].endswith(
            f"another daemon (pid {d.proc.pid}) already runs with runtime dir {run}; stop it first or pass another --runtime-dir")
        victim = Hang(d)
        try:
            victim.stored_in_time()
        finally:
            victim.stop()
    finally:
        d.stop()


@needs_root
def test_a_registered_process_that_execs_a_setuid_program_is_not_ptraced_for_its_user(base: Path, attacker: Attacker) -> None:
    suid = base / "suid-python"
    shutil.copy(os.path.realpath(SYSTEM_PYTHON), suid)
    os.chown(suid, 0, 0)
    os.chmod(suid, 0o4755)
    calls = base / "pyspy-calls"
    calls.touch()
    wrapper = base / "py-spy"
    real = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    wrapper.write_text(f"""#!{SYSTEM_PYTHON}
import os, sys, time
pid = sys.argv[sys.argv.index("--pid") + 1]
try:
    uids = next(l for l in open(f"/proc/{{pid}}/status") if l.startswith("Uid:")).split()[1:]
except (OSError, StopIteration):
    uids = []
with open({str(calls)!r}, "a") as f:
    f.write(f"{{time.time()}} {{pid}} {{','.join(uids)}}\\n")
os.execv({real!r}, [{real!r}] + sys.argv[1:])
""")
    wrapper.chmod(0o755)
    config = dict(QUICK, stack_interval=0.2, pyspy_samples_per_uid=20.0)
    with ScratchDaemon(base / "d", config=config, env={"HANGWATCHD_PYSPY": str(wrapper)}) as d:
        proc = attacker.spawn([SYSTEM_PYTHON, "-c", f"""
import os, sys
sys.stdin.readline()
os.execv({str(suid)!r}, [{str(suid)!r}, "-c", "import time; time.sleep(600)"])
"""], user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", stdin=subprocess.PIPE)
        attacker.register(d.runtime_dir, "--pid", str(proc.pid), "--no-beat-file", "--stack-timeout", "600")
        wait_for(lambda: proc.pid in watched_pids(d), 15, "the attacker's process watched by its stack")
        wait_for(lambda: f" {proc.pid} " in calls.read_text(), 15, "py-spy on it while it is the attacker's own")
        victim = Hang(d)
        try:
            proc.stdin.write("go\n")  # type: ignore[union-attr]  # started with a PIPE
            proc.stdin.flush()  # type: ignore[union-attr]  # started with a PIPE
            wait_for(lambda: f"{NOBODY}\t0\t0\t0" in Path(f"/proc/{proc.pid}/status").read_text(), 10, "the setuid exec")
            wait_for(lambda: proc.pid not in watched_pids(d), 15, "the process dropped once it became setuid")
            victim.stored_in_time()
            mixed = [line for line in calls.read_text().splitlines()
                     if line.split()[1] == str(proc.pid) and len(set(line.split()[2].split(","))) > 1]
            # The uids are checked right before py-spy starts and right after it ends; the exec can land
            # in the microseconds between the check and the start. That one sample is thrown away and
            # the process dropped: never a second py-spy on it, and nothing read from it is kept.
            assert len(mixed) <= 1, "py-spy ran as root on a setuid process for its user, again and again"
            events = [e for e in d.logs() if e.get("event") == "registration_refused" and e.get("pid") == proc.pid]
            assert events and events[0]["reason"] == "tampered_setuid"
            assert not [i for i in d.store().list() if proc.pid in i["processes"]]
            assert d.proc.poll() is None
        finally:
            victim.stop()


@needs_root
def test_a_lock_dir_planted_by_a_user_stops_the_daemon_with_one_clear_line(base: Path, attacker: Attacker) -> None:
    run = base / "run"
    run.mkdir()
    os.chmod(run, 0o1777)  # a runtime dir others may write: the only way a user gets to plant it
    attacker.run(f"import os\nos.mkdir({str(run / 'private')!r}, 0o777)")
    res = subprocess.run([sys.executable, "-m", "hangwatchd", "daemon", "--state-dir", str(base / "state"),
                          "--runtime-dir", str(run), "--metrics-address", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].endswith(
        f"{run / 'private'} belongs to uid {NOBODY}, not to the daemon's uid 0; remove it, or pass another --runtime-dir")
    assert not (run / "private" / "daemon.lock").exists()


@needs_root
def test_another_users_hang_on_another_node_never_captures_a_job_of_the_same_name(base: Path, attacker: Attacker,
                                                                                    s3: S3Server) -> None:
    """A job is (owner, name) across nodes too: the attacker's rank of job J hangs on node A; node B
    captures the attacker's own rank of J there, never root's rank of the same name beside it."""
    import psutil

    job = "shared-name"
    fleet = {**QUICK, "store_poll_interval": 0.5, "gpu_dump": "never", "capture_steps": ["proc", "pyspy"]}

    with ScratchDaemon(base / "a", "--store", s3.url(), "--node-name", "node-a", env=s3.env, config=fleet) as a, \
            ScratchDaemon(base / "b", "--store", s3.url(), "--node-name", "node-b", env=s3.env, config=fleet) as b:
        root_rank = b.run(workload_argv(beats=100_000), "--job", job, "--heartbeat-timeout", "60", start_new_session=True)
        try:
            own = run_as(attacker, NOBODY, b, job, 60, 100_000, stdout=subprocess.DEVNULL)  # the attacker's own rank of the job on node B, beating
            wait_for(lambda: len(watched_pids(b)) == 2, 30, "both ranks watched on node B")
            root_pid = wait_for(lambda: [c.pid for c in psutil.Process(root_rank.pid).children()], 10, "root's rank")[0]
            own_pid = next(p for p in watched_pids(b) if p != root_pid)
            run_as(attacker, NOBODY, a, job, 2, 20, stdout=subprocess.DEVNULL)  # hangs on node A
            (inc,) = wait_for(lambda: [i for i in b.store().list() if i["reason"] == "job-request"], 60,
                              "node B's capture for node A's request")
            assert inc["processes"] == [own_pid]  # the attacker's own rank, not root's of the same name
            b.event("hang_acted", incident=inc["id"])  # node B is done with the request: nothing else of it comes
            assert all(root_pid not in i["processes"] for i in b.store().list())
            assert own.poll() is None
        finally:
            stop(root_rank, group=True)
