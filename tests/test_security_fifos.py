"""The trust boundary, attacked through what came with the GPU exception FIFOs: the helper that reads a
frame's line of code as the process's user, the FIFOs the daemon makes for every program below a
workload, and the kernel log the XIDs are read from.

The daemon runs as root, the attacker as uid 65534 (nobody), with the system's Python and nothing of
hangwatchd's but what ``hangwatchd run`` needs. The attacker's programs are in tests/attackjobs. Each
test asserts what a user of the node would see: root's secrets stay root's, a root workload's hang
is still stored within its heartbeat timeout + 6 s, and the node is not reported at fault. As an
ordinary user these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path

import psutil
import pytest

from hangwatchd.testing import ScratchDaemon, wait_for

from .conftest import hangwatchd
from .test_security import NOBODY, QUICK, SYSTEM_PYTHON, Attacker, RootHang, attacker, base, needs_root  # noqa: F401 - fixtures (base, attacker)
from .test_security_paths import user_env

JOBS = Path(__file__).parent / "attackjobs"
SECRET = "root-only-store-secret-3f9a"  # what systemd's EnvironmentFile (root's, 0600) gives the daemon


def run_job(attacker: Attacker, d: ScratchDaemon, job: str, *argv: str, **kw: object) -> subprocess.Popen[str]:
    """``hangwatchd run --job JOB -- python3 tests/attackjobs/ARGV...`` as uid 65534."""
    return attacker.spawn([SYSTEM_PYTHON, "-m", "hangwatchd", "run", "--runtime-dir", str(d.runtime_dir), "--job", job,
                           "--heartbeat-timeout", "30", "--", SYSTEM_PYTHON, str(JOBS / argv[0]), *argv[1:]],
                          user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env=user_env(), **kw)


@needs_root
def test_the_helper_that_reads_a_line_of_code_never_carries_the_daemons_environment(base: Path,
                                                                                     attacker: Attacker) -> None:
    """The daemon's environment holds the shared store's keys (the unit's EnvironmentFile, root's alone).
    A user's own GPU exception (a CUDA coredump's header written into its own FIFO, from a function
    named ``synchronize``) makes the daemon read the line it stalls at with a helper that runs as that
    user; a process of one's own uid shows its /proc/PID/environ to its user. The helper must carry
    none of the daemon's environment: the spy catches it, and finds no key in it."""
    spied = base / "spied"
    spied.mkdir()
    os.chmod(spied, 0o777)
    out = spied / "environ"
    with ScratchDaemon(base, env={"AWS_SECRET_ACCESS_KEY": SECRET}, config=QUICK) as d:
        job = run_job(attacker, d, "evil", "env_spy.py", str(out))

        def reader_seen() -> list[bytes] | None:
            text = out.read_bytes() if out.exists() else b""
            found = [e for e in text.split(b"\n----\n") if b"\0-I\0-S\0-c\0" in e.split(b"\0\0", 1)[0]]
            return found or None

        caught = wait_for(reader_seen, 60, "the line reader, run as the attacker, seen by the attacker's spy")
        readers = [int(e.split(b"\0", 1)[0].rsplit(b"\n", 1)[-1]) for e in caught]
        wait_for(lambda: not any(psutil.pid_exists(p) for p in readers), 30, "the line reader done")  # before the process goes
        job.kill()  # the "driver" goes: its dump is cut short, and the incident is filed
        (inc,) = wait_for(lambda: [i for i in d.settled() if i["job"] == "evil"], 60, "the attacker's exception incident")
        verdict = json.loads((Path(inc["dir"]) / "incident.json").read_text())["verdict"]
        assert "surfaced in `threading.Event().wait()` (env_spy.py:" in verdict, verdict  # the line was read, as the user
    for entry in caught:
        assert SECRET.encode() not in entry, "the daemon's secret was read by uid 65534: " + entry.decode(errors="replace")[:300]
    assert SECRET.encode() not in out.read_bytes()


@needs_root
def test_programs_below_one_users_workloads_cannot_use_up_the_daemons_descriptors(base: Path, attacker: Attacker) -> None:
    """Under systemd's default limit (LimitNOFILE: 1024 soft), one user's job starts 300 programs below
    it (the daemon makes each an exception FIFO: a read end, a write end and a pidfd) and registers
    63 more of its own processes by hand (each another FIFO, past the cap on programs below). The
    daemon must still admit and capture a root workload's hang within its timeout + 6 s."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 4096:
        pytest.skip(f"the hard limit on open files here is {hard}: the daemon could not go past systemd's soft 1024 anyway")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the daemon gets from systemd's defaults
    try:
        d = ScratchDaemon(base, config=QUICK)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        job = run_job(attacker, d, "flood", "fifo_flood.py", "300", "63", stdout=subprocess.PIPE)
        assert job.stdout is not None and job.stdout.readline().split()[0] == "started"
        fifos = d.dump_dir / "exceptions" / str(NOBODY)
        # The cap on programs below (256), then the 63 registered; or the daemon could make no more.
        wait_for(lambda: len(os.listdir(fifos)) >= 256 + 63 or b"Too many open files" in d.log.read_bytes(), 60,
                 "the attacker's FIFOs made")
        root = RootHang(d)
        try:
            root.stored_in_time()
        finally:
            root.stop()
        assert b"Too many open files" not in d.log.read_bytes()
    finally:
        d.stop()


@needs_root
def test_a_segfault_named_like_an_xid_line_is_no_gpu_fault(base: Path, attacker: Attacker) -> None:
    """Any user puts text of their own into the kernel log: the kernel logs a segfault with the name of
    the file mapped where it happened (``... error 15 in NAME[7f...+1000]``). A file named
    ``NVRM: Xid (PCI:...): 79, ... GPU has fallen off the bus.`` must not become an XID: no GPU fault in
    ``hangwatchd health`` (which would have the node drained), no XID counted."""
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("this system has no readable /dev/kmsg")
    scratch = base / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o777)
    forged = "NVRM: Xid (PCI:0000:ee:1f): 79, pid=1, name=python3, GPU has fallen off the bus."
    with ScratchDaemon(base, config=QUICK) as d:
        assert d.info.get("pid")
        kmsg = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        try:
            os.lseek(kmsg, 0, os.SEEK_END)
            said = attacker.run(f"import runpy, sys; sys.argv = ['forge', {str(scratch)!r}, {forged!r}]; "
                                f"runpy.run_path({str(JOBS / 'forge_xid.py')!r}, run_name='__main__')")
            assert "signal 11" in said, said

            def logged() -> bool:
                while True:
                    try:
                        record = os.read(kmsg, 16384)
                    except BlockingIOError:
                        return False
                    except OSError:  # EPIPE: records overwritten meanwhile; read on
                        continue
                    if b"segfault" in record and forged.encode() in record:
                        return True
            try:
                wait_for(logged, 5, "the segfault's line in the kernel log")
            except Exception:  # noqa: BLE001 - the kernel's choice (debug.exception-trace = 0, rate limits), not ours
                pytest.skip("the kernel did not log the segfault (debug.exception-trace = 0 or its rate limit)")
        finally:
            os.close(kmsg)
        d.looked(3, what="rescan")  # the kernel log's reader has had the line for three rescans (a second each)
        res = hangwatchd("health", "--runtime-dir", str(d.runtime_dir))
        assert "XID" not in res.stdout and "fallen off" not in res.stdout, res.stdout
        health = json.loads((d.runtime_dir / "health.json").read_text())
        assert health.get("gpu_faults") == [], health.get("gpu_faults")
        assert d.metric_total("hangwatchd_gpu_xid_errors_total") == 0


@needs_root
def test_a_program_the_symbolising_child_runs_as_the_dumps_owner_carries_no_secret(base: Path, attacker: Attacker,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The child that reads a user's dump drops to the user, then may run a program (nvdisasm, where a
    dump's line table cannot be read: a hostile dump's choice). That program is the user's to look at
    (/proc/PID/environ): it must not carry the daemon's environment. The child's helper (its test hook,
    a ``sleep`` in its place) is read by uid 65534 while it runs."""
    import lzma
    import threading

    from hangwatchd.cudacore import sandbox

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    sandbox.stop()  # one started earlier in this process has another environment
    sandbox.start()
    try:
        dump = base / "d.nvcudmp"
        dump.write_bytes(lzma.decompress((Path(__file__).parent / "fixtures" / "gpu" / "cpp_ima" / "coredump.nvcudmp.xz")
                                         .read_bytes()))
        os.chown(dump, NOBODY, NOBODY)
        where = base / "w"
        where.mkdir()
        os.chmod(where, 0o1777)
        pidfile = where / "pid"
        done: list[object] = []

        def stopped() -> None:
            try:
                done.append(sandbox.symbolize(dump, sandbox.Limits(30, 1024, 5), _hook=f"sleep:{pidfile}"))
            except Exception as exc:  # noqa: BLE001 - stopped at its wall deadline, as meant
                done.append(exc)
        t = threading.Thread(target=stopped)
        t.start()
        try:
            pid = int(wait_for(lambda: pidfile.read_text() if pidfile.exists() else None, 10, "the child's program"))
            seen = attacker.run(f"import sys; sys.stdout.write(open('/proc/{pid}/environ', 'rb').read().decode(errors='replace'))")
        finally:
            t.join()
        assert "PATH=" in seen, seen  # read as the dump's owner: it is theirs to read
        assert SECRET not in seen, "uid 65534 read the daemon's environment in the symbolising child's program"
    finally:
        sandbox.stop()


@needs_root
def test_programs_started_past_the_cap_on_fifos_cost_one_log_line(base: Path, attacker: Attacker) -> None:
    """Past its 256 FIFOs of programs below, a user's job starts a program every few milliseconds
    (each lives half a second, long enough for the daemon to look at it): each is refused a FIFO,
    and the log says so once, not once a program (the per-user budget is 60 lines a minute)."""
    with ScratchDaemon(base, config=QUICK) as d:
        job = run_job(attacker, d, "storm", "exec_storm.py", "256", "5", stdout=subprocess.PIPE)
        assert job.stdout is not None
        started = job.stdout.readline().split()
        assert started[0] == "started", started
        done = job.stdout.readline().split()
        assert done[0] == "stormed" and int(done[1]) > 200, done  # programs started past the cap
        d.looked(2, what="rescan")  # the loop has handed the last of them to the FIFOs' thread
        refused = [e for e in d.logs() if e.get("event") == "exception_fifo_refused"]
        assert 1 <= len(refused) <= 2, f"{len(refused)} lines for one user's programs past the cap"
        assert all(e.get("uid") == NOBODY for e in refused)


@needs_root
def test_a_program_below_that_became_setuid_is_not_read_for_its_user(base: Path, attacker: Attacker) -> None:
    """A program below the attacker's job gets its FIFO while it runs as the attacker, then execs a
    setuid-root program (passwd, waiting for a password). A CUDA coredump's header written into the
    FIFO (the attacker's own) must not make root read that process for the attacker: no /proc
    facts (its memory at its system call's arguments, its environment), no stacks, in an incident the
    attacker may read."""
    with ScratchDaemon(base, config=QUICK) as d:
        job = run_job(attacker, d, "setuid", "setuid_after_fifo.py", stdout=subprocess.PIPE)
        assert job.stdout is not None
        said = job.stdout.readline().split()
        assert said and said[0] == "begun", said
        pid = int(said[1])
        d.event("exception_begun", 30, pid=pid)
        os.kill(pid, 9)  # passwd goes: what came of its "dump" is filed
        (inc,) = wait_for(lambda: [i for i in d.settled() if i["job"] == "setuid"], 60, "the exception's incident")
        pdir = Path(inc["dir"]) / str(pid)
        read = sorted(p.name for p in pdir.iterdir()) if pdir.exists() else []
        assert not {"proc.json", "pyspy.json", "pyspy-native.json"} & set(read), \
            f"root read a setuid-root process for uid {NOBODY}: {read}"
        steps = {s["step"]: s for s in json.loads((Path(inc["dir"]) / "incident.json").read_text())["processes"][0]["steps"]}
        assert "mixed uids" in (steps["proc"].get("error") or ""), steps  # said in the incident


@needs_root
def test_one_users_dumps_never_evict_another_users_dump(base: Path, attacker: Attacker, tmp_path: Path) -> None:
    """A root workload's GPU exception is stored with its dump. Then one user pours three dumps of
    random bytes (45 MB each, which no compressor makes smaller; the cap is 8 GiB, six a minute)
    through the exception FIFOs of programs of their own. The state dir passes max_state_bytes (100 MB
    here, 50 GiB by default): retention must make room from that user's dumps, never remove the
    root workload's."""
    from .test_gpu_fault import fault

    with ScratchDaemon(base, config={**QUICK, "max_state_bytes": "100MB"}) as d:
        work = fault(d, "illegal_address.py", "whole", tmp_path, job="root-victim")
        (victim,) = wait_for(lambda: [i for i in d.settled() if i["job"] == "root-victim"], 60, "the root workload's exception")
        work.wait(timeout=30)
        kept = [p for p in Path(victim["dir"]).rglob("coredump.nvcudmp.zst")]
        assert kept, "the root workload's dump was not kept in the first place"
        job = run_job(attacker, d, "flood", "dump_flood.py", "3", "45", stdout=subprocess.PIPE)
        assert job.stdout is not None and job.stdout.readline().split() == ["flooded", "3"]
        wait_for(lambda: len([i for i in d.settled() if i["job"] == "flood"]) >= 3, 120, "the attacker's three incidents")
        d.event("retention_removed", 60)  # over max_state_bytes: retention made room
        d.event("retention_checked", 60)
        assert all(p.exists() for p in kept), "one user's dumps made retention remove the root workload's dump"


@needs_root
def test_no_user_can_take_the_name_of_another_users_driver_log(base: Path, attacker: Attacker) -> None:
    """``hangwatchd run`` keeps the CUDA driver's lines of its workload in RUNTIME_DIR/driver-logs,
    for the daemon to put beside the dump. A user who could create a name there first (for another
    user's pid to come) would keep that user's lines out of their incident. driver-logs is the daemon's,
    and each user's directory in it is made by the daemon for that user: the attacker can create nothing
    in it, not even their own directory, and their own job's lines still reach their own incident.
    What an earlier version left (driver-logs world-writable, a name the attacker took in it) is set aside."""
    from .conftest import FIXTURES

    lines = base / "stderr.log"
    lines.write_bytes((FIXTURES / "graph_ima" / "stderr.log").read_bytes())
    os.chmod(lines, 0o644)
    logs = base / "d" / "run" / "driver-logs"
    logs.mkdir(parents=True)
    os.chmod(logs, 0o1777)
    attacker.run(f"import os; os.mkdir({str(logs / '0')!r})")
    with ScratchDaemon(base / "d", config=QUICK) as d:
        assert logs == d.runtime_dir / "driver-logs" and not (logs / "0").exists()
        (old,) = d.runtime_dir.glob(".driver-logs-shared-*")
        assert (old / "0").stat().st_uid == NOBODY
        tried = attacker.run(f"""
import os
for name in ("0", "{NOBODY}", "1000"):
    try:
        os.mkdir(os.path.join({str(logs)!r}, name))
        print(name, "made")
    except PermissionError:
        print(name, "refused")
try:
    open(os.path.join({str(logs)!r}, "{os.getpid() + 100}.log"), "w")
    print("file made")
except PermissionError:
    print("file refused")
""")
        assert tried.split() == ["0", "refused", str(NOBODY), "refused", "1000", "refused", "file", "refused"], tried
        job = run_job(attacker, d, "lines", "driver_lines.py", str(lines))
        try:
            (log_file,) = wait_for(lambda: [f for f in (logs / str(NOBODY)).glob("*.log") if f.stat().st_size] if (logs / str(NOBODY)).is_dir()
                                   else None, 60, "the job's driver lines kept by its launcher")
            mine, theirs = os.stat(logs), os.stat(logs / str(NOBODY))
            assert (mine.st_uid, oct(mine.st_mode & 0o7777)) == (0, "0o755")
            assert (theirs.st_uid, oct(theirs.st_mode & 0o7777)) == (NOBODY, "0o755")
            wait_for(lambda: any(e.get("event") == "exception_looked" for e in d.logs()), 60, "the stacks taken while it stalls")
        finally:
            job.kill()  # the "driver" goes: its dump is cut short, and the incident is filed
        (inc,) = wait_for(lambda: [i for i in d.settled() if i["job"] == "lines"], 60, "the user's exception incident")
        (pid,) = inc["processes"]
        assert log_file.name == f"{pid}.log"
        kept = (Path(inc["dir"]) / str(pid) / "driver.log").read_text()
        assert "coredump: Detected an exception of type CUDBG_EXCEPTION_WARP_ILLEGAL_ADDRESS (14)" in kept, kept
