"""Trust boundary 3: what a user's process hands the daemon is parsed where it cannot hurt, and a
user's descriptor is written only as it was found.

The daemon runs as root, the attacker as uid 65534 (nobody). Each attack goes through the newest
doors: the flight recorder's FIFO and its trace (asked by the warm-up as a rank starts, and by a
capture), the registration's ``launcher`` and ``on_hang``, a store request, files planted in the
dump dir. Each test asserts what a user of the node would see: root's files unchanged, nothing
done to another user's process, the daemon healthy (its loop turning, its memory bounded), and a
root workload that hangs during the attack stored within its timeout + 10 s.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, stop, wait_for, workload_argv
from hangwatchd.workload import ended

from .s3server import S3Server
from .test_security import NOBODY, QUICK, TIMEOUT, Attacker, RootHang, attacker, base, needs_root  # noqa: F401 - fixtures (base, attacker) and names the tests below use
from .test_security_budgets import post_request, s3_client

SLACK = 10.0


# -- hostile traces: each a few bytes to a few MB, each once a stall or a flood of memory -------

def _dag(levels: int = 40) -> list[object]:
    x: list[object] = []
    for _ in range(levels):
        x = [x, x]
    return x


def dag_trace() -> bytes:
    """727 bytes that were minutes of one str() holding the GIL: lists that share themselves."""
    d = _dag()
    entry = {"profiling_name": d, "state": d, "process_group": [d, d], "collective_seq_id": 1,
             "frames": [{"name": d, "filename": d, "line": d}], "input_sizes": d, "input_dtypes": d}
    return pickle.dumps({"version": "2.4", "pg_status": {"0": {"last_enqueued_collective": d}}, "entries": [entry]},
                        protocol=2)


def memo_trace() -> bytes:
    """9 bytes asking the unpickler for a memo of 2**31 slots (gigabytes)."""
    return b"\x80\x02]r\xff\xff\xff\x7f."


def deep_trace(depth: int = 100_000) -> bytes:
    """A dict whose entries are lists nested 100,000 deep (a RecursionError for whoever recurses)."""
    return (b"\x80\x02}(X\x07\x00\x00\x00entries" + b"]" * depth + b"a" * (depth - 1) + b"u.")


def huge_string_trace() -> bytes:
    """Fifteen MB of name: cut to a few hundred characters, never copied whole into the incident."""
    return pickle.dumps({"entries": [{"profiling_name": "nccl:" + "x" * (15 << 20), "frames": []}]}, protocol=4)


HOSTILE = {"dag": dag_trace, "memo": memo_trace, "deep": deep_trace, "string": huge_string_trace}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Health:
    """``hangwatchd health`` asked every half second on a thread: the node must stay fine (the loop
    rewrites its status at least every 10 s: stalled past 15 s is a loop that stopped turning)."""

    def __init__(self, d: ScratchDaemon) -> None:
        self.d = d
        self.answers: list[tuple[int, str]] = []
        self.peak_rss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            res = subprocess.run(hangwatchd_argv("health", "--runtime-dir", str(self.d.runtime_dir), "--stalled-after", "15"),
                                 capture_output=True, text=True, timeout=30)
            self.answers.append((res.returncode, res.stdout.strip()))
            self.peak_rss = max(self.peak_rss, rss_mb(self.d.proc.pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=40)
        bad = [a for a in self.answers if a[0] != 0]
        assert self.answers and not bad, f"the node was reported at fault during the attack: {bad[:3]}"


@pytest.fixture
def trace_dir(base: Path) -> Path:
    """The attacker's own directory for its FIFO and its trace."""
    d = base / "fr"
    d.mkdir()
    os.chown(d, NOBODY, NOBODY)
    return d


def fr_env(trace_dir: Path) -> dict[str, str]:
    return dict(os.environ, TORCH_NCCL_DEBUG_INFO_PIPE_FILE=str(trace_dir / "fr_"),
                TORCH_FR_DUMP_TEMP_FILE=str(trace_dir / "trace_"))


def answered(proc: subprocess.Popen[str]) -> None:
    """Wait for the attacker to say it handed its trace over (its next line)."""
    line = proc.stdout.readline()  # type: ignore[union-attr]  # started with a PIPE
    assert line.strip() == "answered", line


# -- Critical 1: root writes a byte into a file the user can only read -------------------------

@needs_root
def test_a_root_file_put_under_the_flight_recorders_descriptor_is_never_written(base: Path, attacker: Attacker,
                                                                                 trace_dir: Path) -> None:
    secret = base / "root-owned.txt"
    original = b"ROOT-OWNED " + os.urandom(8).hex().encode() + b"\n"
    secret.write_bytes(original)
    os.chmod(secret, 0o644)  # the attacker may read it, never write it
    with ScratchDaemon(base / "d", config=QUICK) as d:
        victim = RootHang(d)
        try:
            for attempt in range(3):
                fr = trace_dir / f"try{attempt}"
                fr.mkdir()
                os.chown(fr, NOBODY, NOBODY)
                proc, _ = attacker.register(d.runtime_dir, "--timeout", "60", "--fr", str(fr), "--fr-swap", str(secret),
                                            env=fr_env(fr))
                # The warm-up finds the FIFO, opens the trace's directory (the attacker swaps a read-only
                # fd of root's file under the FIFO's number that instant) and writes: refused.
                assert proc.stdout.readline().strip() == "swapped"  # type: ignore[union-attr]  # started with a PIPE
                if attempt == 0:
                    victim.stored_in_time()  # root's own hang, captured in time during the attack
                failed = d.event("flight_recorder_warmup_failed", 30, pid=proc.pid)
                assert secret.read_bytes() == original
                if "no trace within" not in failed["error"]:
                    break
                # The attacker's swap came after the daemon's write, which went to the attacker's own FIFO
                # (a loaded machine): the race this test sets up was not run. Again, with a new process.
            assert "refusing to write" in failed["error"] and "not a FIFO" in failed["error"], failed
        finally:
            victim.stop()


def test_a_descriptor_swapped_after_it_was_found_is_refused(tmp_path: Path) -> None:
    """The rule itself, for any user: the write goes only to the FIFO found, by its device and inode."""
    from hangwatchd.host import untrusted

    fifo = tmp_path / "fr_0.pipe"
    os.mkfifo(fifo)
    plain = tmp_path / "plain"
    plain.write_bytes(b"unchanged")
    other = tmp_path / "other.pipe"
    os.mkfifo(other)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    r_other = os.open(other, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(r)
        me = os.getuid()
        untrusted.write_held_fifo(os.getpid(), r, me, (st.st_dev, st.st_ino), b"1")
        assert os.read(r, 8) == b"1"
        ro = os.open(plain, os.O_RDONLY)
        os.dup2(ro, r)  # the number now names a regular file, open read-only
        with pytest.raises(untrusted.Refused, match="not a FIFO"):
            untrusted.write_held_fifo(os.getpid(), r, me, (st.st_dev, st.st_ino), b"1")
        assert plain.read_bytes() == b"unchanged"
        os.dup2(r_other, r)  # another FIFO of the same user: not the one found
        with pytest.raises(untrusted.Refused, match="no longer the FIFO found"):
            untrusted.write_held_fifo(os.getpid(), r, me, (st.st_dev, st.st_ino), b"1")
        with pytest.raises(untrusted.Refused, match="belongs to uid"):
            untrusted.write_held_fifo(os.getpid(), r_other, me + 1, (os.fstat(r_other).st_dev, os.fstat(r_other).st_ino), b"1")
        os.close(ro)
    finally:
        os.close(r)
        os.close(r_other)


# -- Critical 2, High 3, 8: traces that stall the loop, flood memory, or recurse -----------------

@needs_root
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_trace_handed_to_the_warm_up_costs_its_bytes_and_no_more(kind: str, base: Path, attacker: Attacker,
                                                                           trace_dir: Path) -> None:
    answer = base / f"{kind}.pkl"
    answer.write_bytes(HOSTILE[kind]())
    os.chmod(answer, 0o644)
    with ScratchDaemon(base / "d", config=QUICK) as d:
        before = rss_mb(d.proc.pid)
        health = Health(d)
        victim = RootHang(d, beats=60)  # it hangs about 3 s in: while the trace is being read
        try:
            proc, _ = attacker.register(d.runtime_dir, "--timeout", "60", "--fr", str(trace_dir), "--fr-answer",
                                        str(answer), env=fr_env(trace_dir))
            answered(proc)
            victim.stored_in_time()
            time.sleep(1.0)  # the trace read to its end (the warm-up's parse runs beside the loop)
        finally:
            victim.stop()
            health.stop()
        grew = health.peak_rss - before
        assert grew < 300, f"the daemon grew by {grew:.0f} MB reading a {answer.stat().st_size}-byte trace"
        assert d.proc.poll() is None


@needs_root
def test_a_hostile_trace_in_a_capture_stalls_neither_the_daemon_nor_show(base: Path, attacker: Attacker,
                                                                        trace_dir: Path) -> None:
    answer = base / "dag.pkl"
    answer.write_bytes(dag_trace())
    os.chmod(answer, 0o644)
    config = dict(QUICK, flight_recorder_warmup=False)
    with ScratchDaemon(base / "d", config=config) as d:
        health = Health(d)
        victim = RootHang(d, beats=80)
        try:
            # The attacker's own process hangs (no beats): its capture asks its flight recorder,
            # which answers with the DAG; the analysis reads it as the incident is made.
            proc, _ = attacker.register(d.runtime_dir, "--timeout", "1", "--beats", "5", "--fr", str(trace_dir),
                                        "--fr-answer", str(answer), env=fr_env(trace_dir))
            mine = wait_for(lambda: [i for i in d.settled() if proc.pid in i["processes"]], 40, "the attacker's incident")[0]
            victim.stored_in_time()
            start = time.monotonic()
            shown = subprocess.run(hangwatchd_argv("show", str(mine["id"]), "--state-dir", str(d.state_dir)),
                                   capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0, shown.stderr
            assert time.monotonic() - start < 10
        finally:
            victim.stop()
            health.stop()


def test_every_hostile_trace_is_parsed_or_refused_within_its_bounds() -> None:
    """The flight recorder's parser on the hostile corpus (any user): a few seconds and a bounded
    result each, never an exception, never a recursion."""
    import tracemalloc

    from hangwatchd.analyze import flight

    for name, make in HOSTILE.items():
        raw = make()
        tracemalloc.start()
        start = time.process_time()
        record, why = flight.parse(raw)
        cpu = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert cpu < 10, f"{name}: {cpu:.1f} s of CPU"
        assert peak < 40 * len(raw) + (64 << 20), f"{name}: {peak >> 20} MB for {len(raw)} bytes"
        if record is not None:
            text = json.dumps([(e.name, e.state, e.frames, e.input_sizes) for e in record.entries])
            assert len(text) < 1 << 20, f"{name}: {len(text)} characters of entries"
        else:
            assert why, name


# -- High 4: a registration names another user's process as its launcher ------------------------

@needs_root
def test_a_launcher_of_another_user_gets_no_ended_record_from_an_abort(base: Path, attacker: Attacker) -> None:
    with ScratchDaemon(base / "d", config=QUICK) as d:
        # The victim (root's job) runs healthy under hangwatchd run, beating for a long time.
        victim = d.run(workload_argv(beats=100_000, interval=0.05), "--heartbeat-timeout", "30", "--job", "victim",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            wait_for(lambda: "victim" in watched_jobs(d), 15, "the victim watched")
            from hangwatchd.host import procfs

            victim_id = procfs.identify(victim.pid)
            assert victim_id is not None
            proc, _ = attacker.register(d.runtime_dir, "--timeout", "1", "--beats", "5", "--launcher", str(victim.pid),
                                        "--on-hang", "abort")
            refused = d.event("launcher_refused", 15, pid=proc.pid)
            assert refused["uid"] == NOBODY and refused["launcher"] == victim.pid
            d.event("job_aborted", 30)  # the attacker's own process: its own word
            assert proc.wait(20) != 0
            assert not ended.path_of(d.runtime_dir, victim_id).exists()
            assert victim.poll() is None
        finally:
            stop(victim, group=True)
        out = victim.stderr.read().decode()  # type: ignore[union-attr]  # started with a PIPE
        assert "ended" not in out.lower(), out


def watched_jobs(d: ScratchDaemon) -> set[str]:
    try:
        return {p["job"] for p in json.loads((d.runtime_dir / "status.json").read_text())["processes"]}
    except (OSError, ValueError):
        return set()


# -- High 5: a forged store request with on_hang abort -----------------------------------------

@needs_root
def test_a_store_request_saying_abort_ends_no_healthy_process(base: Path, s3: S3Server) -> None:
    config = {"pyspy_native": False, "store_poll_interval": 0.3, "gpu_dump": "never"}
    with ScratchDaemon(base / "d", "--store", s3.url(), "--node-name", "n1", env=s3.env, config=config) as d:
        work = d.run(workload_argv(beats=100_000, interval=0.05), "--heartbeat-timeout", "30", "--job", "victim",
                     "--on-hang", "abort", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(lambda: "victim" in watched_jobs(d), 15, "the victim watched")
            time.sleep(1.0)  # a poll or two: the node polls the job's request key
            c = s3_client(s3)
            post_request(c, s3, "victim", "job-forged-abort", os.getuid(), on_hang="abort")
            (inc,) = wait_for(lambda: [i for i in d.settled() if i["reason"] == "job-request"], 30, "the requested capture")
            why = d.event("abort_not_taken", 15)
            assert "another node's request" in why["why"]
            assert not [e for e in d.logs() if e.get("event") == "job_aborted"]
            assert work.poll() is None
        finally:
            stop(work, group=True)


# -- Medium 6, 7: log lines and /proc text within a user's budget -------------------------------

@needs_root
def test_refused_registrations_of_a_user_are_logged_within_that_users_budget(base: Path, attacker: Attacker) -> None:
    config = dict(QUICK, log_lines_per_uid_per_minute=10)
    with ScratchDaemon(base / "d", config=config) as d:
        regs = d.runtime_dir / "registrations"
        # Bad files, each written and removed again at once: refused before (or as) they are read.
        attacker.run(f"""
import os, time
for i in range(600):
    p = os.path.join({str(regs)!r}, '%d-1.json' % (10**6 + i))
    with open(p, 'w') as f:
        f.write('{{"pid": 1')
    if i % 2:
        os.unlink(p)
""")
        wait_for(lambda: d.metric_total("hangwatchd_registration_errors_total") >= 250, 30, "the flood counted")
        lines = [e for e in d.logs() if e.get("event") == "registration_refused"]
        assert lines and all("uid" in e for e in lines)
        assert len(lines) <= 2 * 10 + 2, f"{len(lines)} lines logged for one user's flood"


@needs_root
def test_children_with_huge_command_lines_cost_a_capped_incident(base: Path) -> None:
    code = ("import subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'] + ['x' * 120_000] * 8) for _ in range(16)]\n"
            "time.sleep(600)\n")
    with ScratchDaemon(base / "d", config=QUICK) as d:
        work = d.run([sys.executable, "-c", code], "--stack-timeout", "3", "--job", "bigcmd",
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            (inc,) = wait_for(lambda: d.settled() or None, 40, "the incident")
            total = sum(p.stat().st_size for p in Path(inc["dir"]).rglob("*") if p.is_file())
            assert total < 4 << 20, f"the incident holds {total >> 20} MB"
            children = [json.loads(p.read_text()) for p in Path(inc["dir"]).glob("*/proc.json")]
            assert len(children) >= 2
            assert all(len(" ".join(c.get("cmdline") or [])) < 20_000 for c in children)
        finally:
            stop(work, group=True)


# -- fuzz: each parser of user content, on bytes made to break it ----------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402 - hypothesis only for the property tests below
from hypothesis import strategies as st  # noqa: E402 - hypothesis only for the property tests below

PLAIN = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
                     | st.binary(max_size=20),
                     lambda kids: st.lists(kids, max_size=5) | st.tuples(kids, kids)
                     | st.dictionaries(st.text(max_size=8) | st.integers(), kids, max_size=5), max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PLAIN, st.integers(2, 5))
def test_plain_data_comes_back_as_pickled(value: object, protocol: int) -> None:
    from hangwatchd.host import plain_pickle

    raw = pickle.dumps(value, protocol=protocol)
    if protocol < 3 and (b"c_codecs" in raw or b"c__builtin__" in raw):
        return  # bytes before protocol 3 are a class call: refused, rightly
    assert plain_pickle.loads(raw) == pickle.loads(raw)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PLAIN, st.integers(2, 5), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
       st.binary(max_size=64))
def test_damaged_pickles_are_refused_in_one_line_or_read(value: object, protocol: int,
                                                          flips: list[tuple[int, int]], tail: bytes) -> None:
    from hangwatchd.analyze import flight
    from hangwatchd.host import plain_pickle

    raw = bytearray(pickle.dumps({"entries": [value], "pg_status": {"0": value}}, protocol=protocol))
    for at, byte in flips:
        raw[at % len(raw)] = byte
    data = bytes(raw) + tail
    try:
        plain_pickle.loads(data)
    except plain_pickle.NotPlainData as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 200
    record, why = flight.parse(data)
    assert record is not None or why


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.binary(max_size=200))
def test_ras_answers_of_any_shape_are_read_or_refused(text: str, junk: bytes) -> None:
    from hangwatchd.analyze import ras

    for body in (text, junk.decode("utf-8", "replace"), '{"communicators": [' + text, text + "\n" * 50 + '"x": 1'):
        for parse in (ras.parse_json, ras.parse_text):
            view, why = parse(body)
            assert view is not None or why
