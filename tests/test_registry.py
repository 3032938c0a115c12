"""Hostile and malformed registrations: each refused with one log line and a counter,
none stops the daemon. The parser is fuzzed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatchd.host import procfs
from hangwatchd.model import ProcessId, Registration
from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv
from hangwatchd.workload import beat_segment, registration_file


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    stop(p, sig=signal.SIGKILL)


def reg_dict(pid: int, start: int, **extra: object) -> dict[str, object]:
    return {"version": 1, "pid": pid, "start_time": start, **extra}


def drop(d: ScratchDaemon, name: str, content: str | bytes) -> Path:
    path = d.runtime_dir / "registrations" / name
    tmp = path.with_name("." + name + ".tmp")
    tmp.write_bytes(content.encode() if isinstance(content, str) else content)
    tmp.replace(path)
    return path


def refused(d: ScratchDaemon, reason: str) -> dict[str, object]:
    def found() -> dict[str, object] | None:
        for e in d.logs():
            if e.get("event") == "registration_refused" and e.get("reason") == reason:
                return e
        return None
    event = wait_for(found, 10, f"a '{reason}' refusal")
    assert d.metric("hangwatchd_registration_errors_total", reason=reason) == 1.0
    return event


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_registration_file_owned_by_another_user_is_refused(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    me = procfs.identify(sleeper.pid)
    assert me is not None
    with ScratchDaemon(tmp_path) as d:
        other = d.runtime_dir / "registrations" / f".{me.pid}-{me.start_time}.json.tmp"
        other.write_text(json.dumps(reg_dict(me.pid, me.start_time)))
        os.chown(other, 12345, 12345)
        other.replace(d.runtime_dir / "registrations" / f"{me.pid}-{me.start_time}.json")
        refused(d, "wrong_owner")


def test_hostile_registrations_are_refused_and_the_daemon_goes_on(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    me = procfs.identify(sleeper.pid)
    assert me is not None
    with ScratchDaemon(tmp_path) as d:
        drop(d, f"{me.pid}-{me.start_time}.json", "{not json")
        refused(d, "bad_json")

        # A pid reused by another program: the start time does not match.
        drop(d, f"{me.pid}-{me.start_time + 1}.json", json.dumps(reg_dict(me.pid, me.start_time + 1)))
        event = refused(d, "pid_reused")
        assert "now belongs to a process started at" in str(event["error"])

        # A beat file outside the runtime dir.
        outside = tmp_path / "elsewhere.beat"
        beat_segment.create(str(outside), me.pid)
        drop(d, f"{me.pid}-{me.start_time}.json", json.dumps(reg_dict(me.pid, me.start_time, beat_file=str(outside))))
        refused(d, "bad_beat_file")
        (d.runtime_dir / "registrations" / f"{me.pid}-{me.start_time}.json").unlink()

        # A symlink to a valid-looking file elsewhere.
        target = tmp_path / "target.json"
        target.write_text(json.dumps(reg_dict(me.pid, me.start_time)))
        (d.runtime_dir / "registrations" / f"{me.pid}-{me.start_time}.json").symlink_to(target)
        refused(d, "symlink")
        (d.runtime_dir / "registrations" / f"{me.pid}-{me.start_time}.json").unlink()

        # A pid that is not running at all.
        drop(d, "999999-1.json", json.dumps(reg_dict(999999, 1)))
        refused(d, "no_process")

        # After all that, a good workload is still watched and caught.
        work = d.run(workload_argv(beats=5, interval=0.02), "--heartbeat-timeout", "1")
        try:
            (inc,) = wait_for(d.settled, 15, "an incident")
            assert inc["reason"] == "heartbeat"
        finally:
            stop(work)
        assert d.proc.poll() is None


def test_load_checks_the_claim_against_proc(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    me = procfs.identify(sleeper.pid)
    assert me is not None
    beats = tmp_path / "beats"
    beats.mkdir()
    regs = tmp_path / "registrations"
    regs.mkdir()
    beat = beats / "b.beat"
    beat_segment.create(str(beat), me.pid)
    reg = Registration(process=me, uid=os.getuid(), job="j", rank=1, heartbeat_timeout=5.0, beat_file=str(beat))
    path = registration_file.write(regs, reg)
    loaded = registration_file.load(path, beats)
    assert (loaded.process, loaded.job, loaded.rank, loaded.heartbeat_timeout, loaded.beat_file) == (me, "j", 1, 5.0, str(beat))
    sleeper.kill()
    sleeper.wait()
    with pytest.raises(registration_file.RegistrationError) as err:
        registration_file.load(path, beats)
    assert err.value.reason == "no_process"


values = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.floats(allow_nan=True),
                   st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(st.sampled_from(["pid", "start_time", "job", "rank", "local_rank", "world_size",
                                             "heartbeat_timeout", "beat_file", "cmdline", "source", "registered_at", "x"]),
                            values, max_size=12),
       raw=st.one_of(st.none(), st.binary(max_size=200)))
def test_fuzz_registration_parser(tmp_path: Path, data: dict[str, object], raw: bytes | None) -> None:
    me = procfs.identify(os.getpid())
    assert me is not None
    regs = tmp_path / "registrations"
    regs.mkdir(exist_ok=True)
    if "pid" in data and data.get("pid") == "self":
        data["pid"] = me.pid
    path = regs / f"{me.pid}-{me.start_time}.json"
    path.write_bytes(raw if raw is not None else json.dumps(data).encode())
    try:
        reg = registration_file.load(path, tmp_path / "beats")
    except registration_file.RegistrationError as exc:
        assert exc.reason and str(path) in str(exc)
    else:
        assert reg.process == ProcessId(me.pid, me.start_time)


def test_beat_in_an_unwatched_process_does_nothing(tmp_path: Path) -> None:
    code = ("import os, hangwatchd; os.environ.pop('HANGWATCHD_BEAT_FILE', None)\n"
            "for _ in range(1000): hangwatchd.beat()\nprint('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert res.stdout.strip() == "ok" and list(tmp_path.iterdir()) == []


def test_beat_counts_and_a_fork_never_beats_for_its_parent(tmp_path: Path) -> None:
    seg = tmp_path / "s.beat"
    code = f"""
import os, time, hangwatchd
from hangwatchd.workload import beat_segment
beat_segment.create({str(seg)!r}, os.getpid())
os.environ['HANGWATCHD_BEAT_FILE'] = {str(seg)!r}
for _ in range(5): hangwatchd.beat()
pid = os.fork()
if pid == 0:
    for _ in range(100): hangwatchd.beat()
    os._exit(0)
os.waitpid(pid, 0)
print(beat_segment.read({str(seg)!r}).count)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.stdout.strip() == "5", res.stderr
    reading = beat_segment.read(str(seg))
    assert reading.age() is not None and 0 <= reading.age() < 30  # type: ignore[operator]  # not None: asserted just before
    assert time.monotonic_ns() >= reading.last_ns
