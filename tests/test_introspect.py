"""The in-process reporter (workload/introspect) and the capture step that asks it (capture/introspect.py).

Each test runs a real workload, one hang pattern each, with the reporter installed the
way ``hangwatchd run`` installs it (its sitecustomize first on PYTHONPATH, a private
directory for the FIFOs), asks it through the daemon's own step, and checks the facts
the wait-for graph needs: which lock a thread waits for and who holds it, the thread
that ended holding one, an RLock's owner, what a join, a future, a pool, a task waits
on. Two run under a real daemon through ``hangwatchd run``. The hostile ones (a FIFO,
a directory or a report planted by someone else) run the workload as uid 65534 and
skip as an ordinary user.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatchd.capture.base import StepFailed, StepNotApplicable
from hangwatchd.capture.introspect import IntrospectStep, NoReporter, reporter_thread
from hangwatchd.host import procfs
from hangwatchd.host.deadline import Deadline
from hangwatchd.testing import ScratchDaemon, hangwatchd_argv, stop, wait_for
from hangwatchd.workload import registration_file
from hangwatchd.workload.launcher import introspect_env

from .conftest import needs_root

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


class Job:
    """A workload with the reporter installed as ``hangwatchd run`` installs it; it prints ``ready``
    (and anything else it wants the test to read) on stdout."""

    def __init__(self, tmp: Path, code: str, python: str = sys.executable, env: dict[str, str] | None = None,
                 introspect: bool = True, **kw: Any) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="introspect-", dir=tmp))
        script = tmp / "job.py"
        script.write_text(textwrap.dedent(code))
        full = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HANGWATCHD_INTROSPECT"))}
        full.update(env or {})
        if introspect:
            introspect_env(full, self.dir)
        self.proc = subprocess.Popen([python, str(script)], env=full, stdout=subprocess.PIPE, text=True, cwd=tmp, **kw)
        self.lines: list[str] = []
        assert self.proc.stdout is not None  # stdout=PIPE
        while True:
            line = self.proc.stdout.readline()
            assert line, f"the workload ended before it was ready (status {self.proc.wait()})"
            self.lines.append(line.strip())
            if line.strip() == "ready":
                break
        time.sleep(0.2)  # the last thread reaches its wait

    def ask(self, pid: int | None = None, timeout: float = 5.0) -> dict[str, Any]:
        out = Path(tempfile.mkdtemp(dir=self.dir.parent))
        target = registration_file.from_proc(pid or self.proc.pid)
        assert target is not None
        assert IntrospectStep().run(target, out, Deadline.after(timeout)) == ("introspect.json",)
        return json.loads((out / "introspect.json").read_text())

    def stop(self) -> None:
        for kid in procfs.descendants(self.proc.pid, 64):
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop(self.proc, sig=signal.SIGKILL)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Any]:
    started: list[Job] = []

    def start(code: str, **kw: Any) -> Job:
        j = Job(tmp_path, code, **kw)
        started.append(j)
        return j

    yield start
    for j in started:
        j.stop()


def thread(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in report["threads"] if t["name"] == name)


def test_a_thread_waiting_in_with_names_the_lock_another_thread_holds_in_its_own_with(job: Any) -> None:
    j = job("""
        import threading, time
        cache_lock = threading.Lock()
        def update_cache():
            with cache_lock:
                print("ready", flush=True)
                time.sleep(1000)
        def report_stats():
            with cache_lock:
                pass
        threading.Thread(target=update_cache, name="cache").start()
        time.sleep(0.2)
        report_stats()
    """)
    r = j.ask()
    assert r["version"] == 1 and r["pid"] == j.proc.pid
    main, cache = thread(r, "MainThread"), thread(r, "cache")
    w = main["waits"]
    assert w["kind"] == "lock" and w["expr"] == "cache_lock" and w["detail"] == {"locked": True}
    assert w["where"]["function"] == "report_stats" and main["holds"] == []
    (held,) = cache["holds"]
    assert held["id"] == w["id"] and held["expr"] == "cache_lock" and held["how"] == "with"
    assert held["where"]["function"] == "update_cache" and cache["waits"]["kind"] == "sleep"
    assert cache["waits"]["detail"]["seconds"] == 1000
    assert r["locks"][w["id"]]["holders"] == [cache["ident"]] and r["locks"][w["id"]]["waiters"] == [main["ident"]]
    assert cache["target"]["qualname"] == "update_cache" and cache["native_id"] and cache["started"]
    assert r["cost"]["cpu_s"] < 0.5 and r["errors"] == [] and not r["truncated"]


def test_a_thread_that_took_a_lock_and_called_itself_back_waits_for_what_it_holds(job: Any) -> None:
    j = job("""
        import threading
        _table_lock = threading.Lock()
        class Handle:
            def __del__(self):
                release()
        def release():
            with _table_lock:
                pass
        def adopt(key, table={}):
            with _table_lock:
                table[key] = Handle()
        print("ready", flush=True)
        adopt("shard-7")
        adopt("shard-7")
    """)
    main = thread(j.ask(), "MainThread")
    assert main["waits"]["kind"] == "lock" and main["waits"]["where"]["function"] == "release"
    assert [(h["id"], h["where"]["function"]) for h in main["holds"]] == [(main["waits"]["id"], "adopt")]


def test_an_rlock_says_its_owner_and_count(job: Any) -> None:
    j = job("""
        import threading, time
        registry = threading.RLock()
        def refresh():
            with registry:
                with registry:
                    time.sleep(1000)
        threading.Thread(target=refresh, name="refresher", daemon=True).start()
        time.sleep(0.2)
        print("ready", flush=True)
        registry.acquire()
    """)
    r = j.ask()
    w = thread(r, "MainThread")["waits"]
    owner = thread(r, "refresher")["ident"]
    assert w["kind"] == "rlock" and w["expr"] == "registry"
    assert w["detail"] == {"locked": True, "owner": owner, "count": 2}
    assert r["locks"][w["id"]]["holders"] == [owner] and r["locks"][w["id"]]["owner"] == owner


def test_an_rlock_taken_through_a_call_the_source_does_not_show_is_held_by_its_owner(job: Any) -> None:
    j = job("""
        import logging, threading, time
        class SlowHandler(logging.Handler):
            def emit(self, record):
                time.sleep(1000)  # Handler.handle took self.lock through self.acquire()
        handler = SlowHandler()
        log = logging.getLogger("job")
        log.addHandler(handler)
        threading.Thread(target=log.warning, args=("slow",), name="logger", daemon=True).start()
        time.sleep(0.2)
        print("ready", flush=True)
        handler.acquire()
    """)
    r = j.ask()
    w = thread(r, "MainThread")["waits"]
    logger = thread(r, "logger")
    assert w["kind"] == "rlock" and w["detail"]["owner"] == logger["ident"]
    assert [(h["id"], h["how"]) for h in logger["holds"]] == [(w["id"], "owner")]


def test_condition_event_and_queue_with_no_producer_say_what_they_wait_on(job: Any) -> None:
    j = job("""
        import queue, threading, time
        ready = threading.Condition()
        warmed = threading.Event()
        records = queue.Queue(maxsize=8)
        def wait_until_ready():
            with ready:
                ready.wait()
        def wait_for_warmup():
            warmed.wait()
        def read_records():
            return records.get()
        for f in (wait_until_ready, wait_for_warmup, read_records):
            threading.Thread(target=f, name=f.__name__, daemon=True).start()
        print("ready", flush=True)
        time.sleep(1000)
    """)
    r = j.ask()
    cond = thread(r, "wait_until_ready")
    assert cond["waits"]["kind"] == "condition" and cond["waits"]["expr"] == "ready"
    assert cond["waits"]["detail"]["lock_kind"] == "rlock" and cond["waits"]["detail"]["waiting"] == 1
    assert cond["holds"] == []  # Condition.wait let go of it
    ev = thread(r, "wait_for_warmup")["waits"]
    assert ev["kind"] == "event" and ev["expr"] == "warmed" and ev["detail"] == {"is_set": False}
    q = thread(r, "read_records")["waits"]
    assert q["kind"] == "queue" and q["expr"] == "records" and q["api"] == "Queue.get"
    assert q["detail"]["qsize"] == 0 and q["detail"]["unfinished_tasks"] == 0 and q["detail"]["maxsize"] == 8
    assert thread(r, "MainThread")["waits"]["kind"] == "sleep"


def test_a_join_names_the_thread_it_waits_for(job: Any) -> None:
    j = job("""
        import os, threading
        config_r, config_w = os.pipe()
        def fetch_config():
            return os.read(config_r, 4096)
        def run_coordinator():
            fetcher = threading.Thread(target=fetch_config, name="fetcher")
            fetcher.start()
            fetcher.join()
        coordinator = threading.Thread(target=run_coordinator, name="coordinator")
        coordinator.start()
        print("ready", flush=True)
        coordinator.join()
    """)
    r = j.ask()
    fetcher = thread(r, "fetcher")
    w = thread(r, "coordinator")["waits"]
    assert w["kind"] == "thread" and w["expr"] == "fetcher"
    assert w["detail"] == {"ident": fetcher["ident"], "name": "fetcher", "alive": True, "daemon": False}
    assert thread(r, "MainThread")["waits"]["detail"]["name"] == "coordinator"
    assert fetcher["waits"]["kind"] == "io" and fetcher["waits"]["detail"]["op"] == "read"
    assert procfs.fd_targets(j.proc.pid)[fetcher["waits"]["detail"]["fd"]].startswith("pipe:")


def test_a_thread_that_returned_holding_a_lock_is_remembered_with_the_lock_it_took(job: Any) -> None:
    j = job("""
        import threading
        journal_lock = threading.Lock()
        pending = []
        def flush_once():
            journal_lock.acquire()
            if not pending:
                return
            pending.clear()
            journal_lock.release()
        t = threading.Thread(target=flush_once, name="flusher")
        t.start()
        t.join()
        print("ready", flush=True)
        with journal_lock:
            pending.append(b"epoch 1 done")
    """)
    r = j.ask()
    w = thread(r, "MainThread")["waits"]
    assert w["kind"] == "lock" and w["expr"] == "journal_lock"
    lock = r["locks"][w["id"]]
    assert lock["locked"] is True and lock["holders"] == [] and lock["waiters"] == [thread(r, "MainThread")["ident"]]
    (gone,) = r["exited_threads"]
    assert gone["name"] == "flusher" and gone["how"] == "returned" and gone["exception"] is None
    assert gone["ended"] >= gone["started"] and gone["native_id"]
    assert gone["target"]["qualname"] == "flush_once" and "journal_lock" in gone["target"]["names"]
    (took,) = gone["target"]["acquires"]
    assert took["id"] == w["id"] and took["expr"] == "journal_lock" and took["line"] == 6 and took["locked"] is True


def test_a_thread_that_died_of_an_exception_says_what_it_raised_and_what_it_held(job: Any) -> None:
    j = job("""
        import json, threading
        index_lock = threading.Lock()
        index = {}
        def load_manifest(text):
            index_lock.acquire()
            index.update(json.loads(text))
            index_lock.release()
        t = threading.Thread(target=load_manifest, args=('{"shard-0": 1, "shard-1"',), name="loader")
        t.start()
        t.join()
        print("ready", flush=True)
        with index_lock:
            print(len(index))
    """, stderr=subprocess.DEVNULL)
    r = j.ask()
    (gone,) = r["exited_threads"]
    exc = gone["exception"]
    assert gone["how"] == "raised" and exc["type"] == "json.decoder.JSONDecodeError"
    assert exc["message"].startswith("Expecting") and exc["frames"][0]["function"].endswith("raw_decode")
    assert any(f["function"] == "load_manifest" and f["line"] == 7 for f in exc["frames"])
    (held,) = exc["holds"]
    assert held["expr"] == "index_lock" and held["how"] == "acquire" and held["id"] == thread(r, "MainThread")["waits"]["id"]


def test_a_thread_pool_whose_only_worker_waits_on_a_task_queued_behind_it(job: Any) -> None:
    j = job("""
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prep")
        def tokenize(text):
            return text.split()
        def prepare_batch(text):
            return pool.submit(tokenize, text).result()
        print("ready", flush=True)
        print(pool.submit(prepare_batch, "the quick brown fox").result())
    """)
    r = j.ask()
    (ex,) = r["executors"]
    (worker,) = ex["threads"]
    main, prep = thread(r, "MainThread"), thread(r, "prep_0")
    assert ex["max_workers"] == 1 and ex["queued"] == 1 and worker["ident"] == prep["ident"] and worker["alive"]
    assert worker["running"]["fn"]["qualname"] == "prepare_batch"
    assert main["waits"]["kind"] == "future" and main["waits"]["id"] == worker["running"]["future"]
    assert main["waits"]["detail"]["running_in"] == prep["ident"] and main["waits"]["detail"]["executor"] == ex["id"]
    w = prep["waits"]
    assert w["kind"] == "future" and w["detail"]["state"] == "PENDING" and w["detail"]["running_in"] is None
    assert w["where"]["function"] == "prepare_batch"


def test_a_pool_map_whose_worker_was_killed_says_which_worker_died_and_how(job: Any) -> None:
    j = job("""
        import multiprocessing as mp, os, signal, time
        def crunch_shard(i):
            if i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
            return i * i
        if __name__ == "__main__":
            with mp.get_context("fork").Pool(2) as pool:
                print("ready", flush=True)
                print(pool.map(crunch_shard, range(6), chunksize=1))
    """)
    time.sleep(1.0)  # the pool notices (every 0.1 s) and replaces the dead worker
    r = j.ask()
    w = thread(r, "MainThread")["waits"]
    assert w["kind"] == "process" and w["expr"] == "pool" and w["detail"]["op"] == "map"
    assert w["detail"]["func"]["qualname"] == "crunch_shard"
    (pool,) = r["pools"]
    assert pool["id"] == w["id"] and pool["processes"] == 2 and len(pool["workers"]) == 2
    (dead,) = pool["exited_workers"]
    assert dead["exitcode"] == -signal.SIGKILL and dead["name"].startswith("ForkPoolWorker-") and dead["pid"]
    assert dead["pid"] not in {x["pid"] for x in pool["workers"]} and all(x["exitcode"] is None for x in pool["workers"])
    assert pool["pending"] == 1 and pool["results"][0]["left"] == 1
    assert {h["role"] for h in pool["handlers"]} == {"worker_handler", "task_handler", "result_handler"}
    assert all(h["alive"] for h in pool["handlers"])
    assert {c["pid"] for c in r["children"]} == {x["pid"] for x in pool["workers"]}


def test_an_asyncio_task_awaiting_a_future_nobody_resolves(job: Any) -> None:
    j = job("""
        import asyncio
        pending = {}
        async def consume(q):
            await q.get()
        async def await_reply(request_id):
            fut = asyncio.get_running_loop().create_future()
            pending[request_id] = fut
            print("ready", flush=True)
            return await fut
        async def main():
            asyncio.get_running_loop().create_task(consume(asyncio.Queue()), name="consumer")
            await await_reply(7)
        asyncio.run(main())
    """)
    r = j.ask()
    (loop,) = r["asyncio"]
    main = thread(r, "MainThread")
    assert loop["thread"] == main["ident"] and loop["running"] and loop["blocked_by_callback"] is None
    assert main["waits"]["kind"] == "asyncio-loop" and main["waits"]["id"] == loop["id"]
    tasks = {t["name"]: t for t in loop["tasks"]}
    top = tasks["Task-1"]
    assert top["coro"]["qualname"] == "main" and [f["function"] for f in top["frames"]] == ["await_reply", "main"]
    aw = top["awaits"]
    assert aw["kind"] == "future" and aw["expr"] == "fut" and aw["where"]["function"] == "await_reply"
    assert aw["detail"]["done"] is False and aw["detail"]["awaited_by"] == [top["id"]]
    q = tasks["consumer"]["awaits"]
    assert q["kind"] == "queue" and q["expr"] == "q" and q["detail"]["qsize"] == 0
    assert not top["done"] and not top["cancelled"]


def test_an_asyncio_lock_held_by_a_cancelled_task_has_no_holder(job: Any) -> None:
    j = job("""
        import asyncio
        async def refresh_cache(lock):
            await lock.acquire()
            await asyncio.sleep(10)
            lock.release()
        async def serve(lock):
            async with lock:
                pass
        async def main():
            lock = asyncio.Lock()
            try:
                await asyncio.wait_for(refresh_cache(lock), timeout=0.1)
            except asyncio.TimeoutError:
                pass
            print("ready", flush=True)
            await serve(lock)
        asyncio.run(main())
    """)
    r = j.ask()
    (task,) = r["asyncio"][0]["tasks"]
    aw = task["awaits"]
    assert aw["kind"] == "lock" and aw["expr"] == "lock" and aw["detail"]["locked"] is True
    lock = r["locks"][aw["id"]]
    assert lock["kind"] == "asyncio-lock" and lock["holder_tasks"] == [] and lock["waiter_tasks"] == [task["id"]]


def test_a_coroutine_that_blocks_the_loop_is_named_as_its_blocker(job: Any) -> None:
    j = job("""
        import asyncio, time
        async def checksum_blocking():
            print("ready", flush=True)
            time.sleep(1000)
        async def main():
            asyncio.get_running_loop().create_task(checksum_blocking(), name="checksum")
            await asyncio.sleep(3600)
        asyncio.run(main())
    """)
    r = j.ask()
    (loop,) = r["asyncio"]
    blocked = loop["blocked_by_callback"]
    assert blocked["function"] == "checksum_blocking" and blocked["task"] == "checksum"
    assert thread(r, "MainThread")["waits"]["kind"] == "sleep"
    tasks = {t["name"]: t for t in loop["tasks"]}
    assert tasks["checksum"]["awaits"] is None  # running, not awaiting
    assert tasks["Task-1"]["awaits"]["kind"] == "sleep" and tasks["Task-1"]["awaits"]["detail"]["seconds"] == 3600


def test_a_fork_child_answers_for_its_own_pid_and_names_the_threads_the_fork_left_behind(job: Any) -> None:
    j = job("""
        import os, threading, time
        send_lock = threading.Lock()
        sending = threading.Event()
        def pump_logs():
            with send_lock:
                sending.set()
                time.sleep(1000)
        threading.Thread(target=pump_logs, name="log-pump", daemon=True).start()
        sending.wait()
        pid = os.fork()
        if pid == 0:
            with send_lock:
                os._exit(0)
        print(pid, flush=True)
        print("ready", flush=True)
        os.waitpid(pid, 0)
    """)
    child = int(j.lines[0])
    parent, kid = j.ask(), j.ask(child)
    assert kid["pid"] == child and kid["fork"]["parent"] == j.proc.pid and parent["fork"] is None
    w = thread(kid, "MainThread")["waits"]
    assert w["kind"] == "lock" and w["expr"] == "send_lock" and kid["locks"][w["id"]]["holders"] == []
    (lost,) = kid["exited_threads"]
    assert lost["name"] == "log-pump" and lost["how"] == "lost_at_fork" and lost["target"]["qualname"] == "pump_logs"
    assert [h["expr"] for h in thread(parent, "log-pump")["holds"]] == ["send_lock"]
    assert thread(parent, "MainThread")["waits"]["detail"] == {"op": "waitpid", "pid": child}
    assert sorted(os.listdir(j.dir)) == sorted(f"introspect-{p}.{x}" for p in (j.proc.pid, child) for x in ("json", "pipe"))


def test_a_spawned_child_gets_the_reporter_through_its_environment(job: Any) -> None:
    j = job("""
        import multiprocessing as mp, time
        def idle(ev):
            ev.wait()
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            ev = ctx.Event()
            p = ctx.Process(target=idle, args=(ev,), name="spawned")
            p.start()
            print(p.pid, flush=True)
            time.sleep(1.0)
            print("ready", flush=True)
            p.join()
    """)
    child = int(j.lines[0])
    r = j.ask(child)
    assert r["pid"] == child and r["fork"] is None
    w = thread(r, "MainThread")["waits"]
    assert w["kind"] == "event" and w["detail"]["multiprocessing"] is True and w["where"]["function"] == "idle"
    parent = j.ask()
    assert thread(parent, "MainThread")["waits"]["kind"] == "process"
    assert thread(parent, "MainThread")["waits"]["detail"]["pid"] == child
    assert [c["name"] for c in parent["children"]] == ["spawned"]


def test_a_user_sitecustomize_still_runs_after_ours(job: Any, tmp_path: Path) -> None:
    mine = tmp_path / "site-of-mine"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("MARK = 'the user sitecustomize ran'\n")
    j = job("""
        import sys, time
        import sitecustomize
        print(sitecustomize.MARK, flush=True)
        print(sys.path.count(sys.path[0]), flush=True)
        print("ready", flush=True)
        time.sleep(1000)
    """, env={"PYTHONPATH": str(mine)})
    assert j.lines[0] == "the user sitecustomize ran"
    assert thread(j.ask(), "MainThread")["waits"]["kind"] == "sleep"


def test_without_introspect_there_is_no_reporter_and_the_step_says_so(tmp_path: Path, job: Any) -> None:
    j = job("""
        import time
        print("ready", flush=True)
        time.sleep(1000)
    """, env={"HANGWATCHD_INTROSPECT": "0"})
    with pytest.raises(NoReporter, match="holds no reporter FIFO"):
        j.ask()
    assert os.listdir(j.dir) == []
    # hangwatchd run --no-introspect: no sitecustomize of ours on the path, the reporter switched off
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(os.environ.get('HANGWATCHD_INTROSPECT'), 'hangwatchd.workload.introspect' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HANGWATCHD_INTROSPECT"))}
    for flags, want in (([], "None True"), (["--no-introspect"], "0 False")):
        res = subprocess.run(hangwatchd_argv("run", "--runtime-dir", str(tmp_path / "run"), *flags, "--", sys.executable, str(probe)),
                             capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
        assert res.returncode == 0 and res.stdout.strip() == want, (flags, res.stdout, res.stderr)


def test_register_installs_the_reporter_where_no_launcher_did(job: Any, tmp_path: Path) -> None:
    run = tmp_path / "run"
    registration_file.prepare_dirs(run)
    j = job(f"""
        import signal, threading, time
        # Started from a background shell (nohup ... &), a process inherits SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import hangwatchd
        assert hangwatchd.register(job="by-hand", runtime_dir={str(run)!r})
        print("ready", flush=True)
        threading.Event().wait()
    """, introspect=False, env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}, stderr=subprocess.DEVNULL)
    r = j.ask()
    assert thread(r, "MainThread")["waits"]["kind"] == "event"
    (own,) = (run / "pipes").iterdir()  # a directory of its own, only its user's
    assert own.name.startswith(f"introspect-{j.proc.pid}-") and own.stat().st_mode & 0o777 == 0o700
    j.proc.send_signal(signal.SIGINT)  # an exit that runs atexit: the FIFO, the report and the directory go
    j.proc.wait(10)
    assert not own.exists()


def test_the_first_beat_installs_the_reporter_where_the_sitecustomize_could_not_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    registration_file.prepare_dirs(run)
    script = tmp_path / "job.py"
    script.write_text("import sys, threading\nimport hangwatchd\nhangwatchd.beat()\nprint('ready', flush=True)\n"
                      "threading.Event().wait()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HANGWATCHD_INTROSPECT"))}
    # python -I ignores PYTHONPATH, and so hangwatchd run's sitecustomize: beat() installs the reporter instead
    launcher = subprocess.Popen(hangwatchd_argv("run", "--runtime-dir", str(run), "--", sys.executable, "-I", str(script)),
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    try:
        assert launcher.stdout is not None and launcher.stdout.readline() == "ready\n"
        time.sleep(0.3)  # into its wait
        (pid,) = procfs.children(launcher.pid)
        target = registration_file.from_proc(pid)
        assert target is not None
        IntrospectStep().run(target, tmp_path, Deadline.after(5.0))
        r = json.loads((tmp_path / "introspect.json").read_text())
        assert r["pid"] == pid and thread(r, "MainThread")["waits"]["kind"] == "event"
        (fifo,) = [p for _, p, _ in procfs.held_fifos(pid) if "introspect-" in p]
        assert Path(fifo).parent.parent == run / "pipes"  # the launcher's directory for the job
    finally:
        for kid in procfs.descendants(launcher.pid, 8):
            os.kill(kid, signal.SIGKILL)
        stop(launcher)


def test_a_process_without_python_has_no_reporter(tmp_path: Path) -> None:
    p = subprocess.Popen(["sleep", "60"])
    try:
        target = registration_file.from_proc(p.pid)
        assert target is not None
        with pytest.raises(StepNotApplicable):
            IntrospectStep().run(target, tmp_path, Deadline.after(2.0))
    finally:
        stop(p)


def test_the_reporter_costs_nothing_while_idle(job: Any) -> None:
    j = job("""
        import threading, time
        print("ready", flush=True)
        threading.Event().wait()
    """)
    fifo = next(fd for fd, path, _ in procfs.held_fifos(j.proc.pid) if path.endswith(f"introspect-{j.proc.pid}.pipe"))
    tid = reporter_thread(j.proc.pid, fifo)
    assert tid is not None, "no thread of the workload blocks reading the reporter's FIFO"

    def cpu() -> tuple[int, int]:
        raw = Path(f"/proc/{j.proc.pid}/task/{tid}/stat").read_bytes()
        fields = raw[raw.rfind(b")") + 2:].split()
        return int(fields[11]), int(fields[12])  # utime, stime in clock ticks

    def switches() -> int:
        status = Path(f"/proc/{j.proc.pid}/task/{tid}/status").read_text()
        return sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)

    before, woke = cpu(), switches()
    time.sleep(3)
    assert cpu() == before and switches() == woke, "the reporter's thread ran while nobody asked"
    j.ask()
    assert switches() > woke  # and it does run when asked


def test_a_report_of_a_hundred_threads_is_built_within_its_budget(job: Any) -> None:
    j = job("""
        import threading, time
        locks = [threading.Lock() for _ in range(50)]
        def holder(i):
            with locks[i]:
                time.sleep(1000)
        def waiter(i):
            lock = locks[i]
            with lock:
                pass
        for i in range(50):
            threading.Thread(target=holder, args=(i,), name=f"holder-{i}", daemon=True).start()
        time.sleep(0.3)
        for i in range(50):
            threading.Thread(target=waiter, args=(i,), name=f"waiter-{i}", daemon=True).start()
        time.sleep(0.3)
        print("ready", flush=True)
        time.sleep(1000)
    """)
    start = time.monotonic()
    r = j.ask()
    took = time.monotonic() - start
    assert len(r["threads"]) == 101 and not r["truncated"] and r["errors"] == []
    assert r["cost"]["cpu_s"] < 0.5 and took < 2.0, (r["cost"], took)
    pairs = {thread(r, f"waiter-{i}")["waits"]["id"] for i in range(50)}
    assert len(pairs) == 50 and all(len(r["locks"][k]["holders"]) == 1 for k in pairs)
    print(f"a report of 101 threads: {r['cost']['cpu_s'] * 1000:.0f} ms of CPU, {took * 1000:.0f} ms asked and read")


def test_a_thread_holding_the_gil_makes_the_step_fail_saying_why(job: Any) -> None:
    j = job("""
        import ctypes, time
        libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL
        print("ready", flush=True)
        libc.sleep(1000)
    """)
    with pytest.raises(StepFailed) as failed:
        j.ask(timeout=1.0)
    assert "waits for the GIL" in str(failed.value), str(failed.value)


def test_the_analyser_never_counts_the_reporters_thread_as_the_programs(job: Any, tmp_path: Path) -> None:
    from hangwatchd.analyze.stacks import read_threads
    from hangwatchd.capture.pyspy import PySpyStep

    j = job("""
        import ctypes
        print("ready", flush=True)
        ctypes.PyDLL(None).sleep(1000)  # the GIL kept from here on: the reporter's thread ran before, or never
    """)
    target = registration_file.from_proc(j.proc.pid)
    assert target is not None
    PySpyStep(native=False).run(target, tmp_path, Deadline.after(20.0))
    seen = json.loads((tmp_path / "pyspy.json").read_text())
    assert len(seen) == 2 and any(f["name"] == "hangwatchd_introspect_reporter" for t in seen for f in t["frames"])
    threads, problems = read_threads(tmp_path)
    assert [t["thread_name"] for t in threads or []] == ["MainThread"] and problems == ()


# -- under a real daemon, through hangwatchd run ----------------------------------------------------------------

HANG = """
import multiprocessing as mp, threading, time
import hangwatchd
journal_lock = threading.Lock()
def flush_once():
    journal_lock.acquire()
def wait_for_orders(ev):
    ev.wait()
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ev = ctx.Event()
    worker = ctx.Process(target=wait_for_orders, args=(ev,), name="orders")
    worker.start()
    t = threading.Thread(target=flush_once, name="flusher")
    t.start()
    t.join()
    for _ in range(20):
        hangwatchd.beat()
        time.sleep(0.05)
    print("stopped beating", flush=True)
    with journal_lock:
        pass
"""


def test_a_hang_under_the_daemon_carries_the_reports_of_the_process_and_its_child(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    with ScratchDaemon(tmp_path / "d", config={"pyspy_native": False, "gpu_dump": "never"}) as d:
        work = d.run([sys.executable, str(script)], "--job", "journal", "--heartbeat-timeout", "2",
                     stdout=subprocess.PIPE, cwd=d.base)
        try:
            assert work.stdout is not None and work.stdout.readline() == b"stopped beating\n"
            (inc,) = wait_for(d.settled, 60, "the incident")
            path = d.store().path_of(inc["id"])
            assert path is not None
            data = json.loads((path / "incident.json").read_text())
            (proc,) = data["processes"]
            steps = {s["step"]: s for s in proc["steps"]}
            assert steps["introspect"]["ok"] and not steps["introspect"]["not_applicable"], steps["introspect"]
            names = [s["step"] for s in proc["steps"]]
            assert names.index("children") < names.index("introspect") < names.index("nvml")  # after its children are known, before anything that may end it
            pid = proc["pid"]
            r = json.loads((path / str(pid) / "introspect.json").read_text())
            w = thread(r, "MainThread")["waits"]
            assert w["kind"] == "lock" and w["expr"] == "journal_lock" and r["locks"][w["id"]]["holders"] == []
            assert r["exited_threads"][0]["target"]["acquires"][0]["id"] == w["id"]
            # The spawned worker, and multiprocessing's resource tracker: each answers for itself.
            kids = json.loads((path / str(pid) / "introspect-children.json").read_text())
            assert len(kids) == 2 and all(o["ok"] for o in kids.values()), kids
            reports = [json.loads((path / kid / "introspect.json").read_text()) for kid in kids]
            assert sorted(r["pid"] for r in reports) == sorted(int(k) for k in kids)
            waits = [thread(r, "MainThread")["waits"] for r in reports]
            assert any(w["where"]["function"] == "wait_for_orders" and w["kind"] == "event" for w in waits), waits
        finally:
            for kid_pid in procfs.descendants(work.pid, 8):
                os.kill(kid_pid, signal.SIGKILL)
            stop(work)


# -- hostile: what a process's user (or another) plants ---------------------------------------------------------

FAKE = """
import os, sys, time
where, mode, planted = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(where, exist_ok=True)
os.chmod(where, 0o777 if mode == "shared-dir" else 0o700)
fifo = os.path.join(where, f"introspect-{os.getpid()}.pipe")
if mode == "foreign-fifo":
    print("make", fifo, flush=True)
    while not os.path.exists(fifo):
        time.sleep(0.05)
else:
    os.mkfifo(fifo, 0o600)
r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
os.set_blocking(r, True)
print("ready", flush=True)
while os.read(r, 64):
    print("asked", flush=True)
    if mode == "symlink":
        os.symlink(planted, os.path.join(where, f"introspect-{os.getpid()}.json"))
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory uid 65534 can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="hangwatchd-introspect-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Fake:
    """A process of uid 65534 that holds a FIFO named like the reporter's and does ``mode`` when asked."""

    def __init__(self, base: Path, mode: str, planted: Path) -> None:
        script = base / "fake.py"
        script.write_text(FAKE)
        self.where = base / "reports"
        self.where.mkdir(mode=0o700)
        os.chown(self.where, NOBODY, NOBODY)
        self.proc = subprocess.Popen([SYSTEM_PYTHON, str(script), str(self.where), mode, str(planted)], user=NOBODY,
                                     group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None  # stdout=PIPE
        first = self.proc.stdout.readline().split()
        if first and first[0] == "make":  # root's FIFO, in the process's own directory, that it may open
            os.mkfifo(first[1], 0o666)
            os.chmod(first[1], 0o666)
            first = self.proc.stdout.readline().split()
        assert first == ["ready"], first

    def asked(self) -> bool:
        self.proc.kill()
        out = self.proc.communicate(timeout=10)[0]
        return "asked" in out


def secret(base: Path) -> Path:
    s = base / "secret"
    s.write_text("root's secret\n")
    os.chmod(s, 0o600)
    return s


@needs_root
def test_another_users_fifo_under_the_reporters_name_is_never_written(base: Path, tmp_path: Path) -> None:
    fake = Fake(base, "foreign-fifo", secret(base))
    target = registration_file.from_proc(fake.proc.pid)
    assert target is not None
    with pytest.raises(StepFailed, match="belongs to uid 0, not uid 65534"):
        IntrospectStep().run(target, tmp_path, Deadline.after(2.0))
    assert not fake.asked() and not (tmp_path / "introspect.json").exists()


@needs_root
def test_a_reporter_directory_others_may_write_is_refused_before_anything_is_asked(base: Path, tmp_path: Path) -> None:
    fake = Fake(base, "shared-dir", secret(base))
    target = registration_file.from_proc(fake.proc.pid)
    assert target is not None
    with pytest.raises(StepFailed, match="writable by others"):
        IntrospectStep().run(target, tmp_path, Deadline.after(2.0))
    assert not fake.asked() and not (tmp_path / "introspect.json").exists()


@needs_root
def test_a_report_planted_as_a_symlink_is_never_followed(base: Path, tmp_path: Path) -> None:
    fake = Fake(base, "symlink", secret(base))
    target = registration_file.from_proc(fake.proc.pid)
    assert target is not None
    with pytest.raises(StepFailed, match="no report within"):
        IntrospectStep().run(target, tmp_path, Deadline.after(1.0))
    assert (fake.where / f"introspect-{fake.proc.pid}.json").is_symlink()
    assert fake.asked() and not (tmp_path / "introspect.json").exists()


@needs_root
def test_another_users_file_under_the_reports_name_is_never_read(base: Path, tmp_path: Path) -> None:
    fake = Fake(base, "quiet", secret(base))
    target = registration_file.from_proc(fake.proc.pid)
    assert target is not None

    def plant() -> None:  # root, here the other user, renames a report of its own into the process's directory
        time.sleep(0.3)
        tmp = fake.where / ".planted"
        tmp.write_text(json.dumps({"version": 1, "pid": fake.proc.pid, "threads": [], "planted": True}))
        os.replace(tmp, fake.where / f"introspect-{fake.proc.pid}.json")

    planter = threading.Thread(target=plant)
    planter.start()
    with pytest.raises(StepFailed, match="no report within"):
        IntrospectStep().run(target, tmp_path, Deadline.after(1.5))
    planter.join()
    assert fake.asked() and not (tmp_path / "introspect.json").exists()


def _pythons() -> list[Any]:
    """Every Python 3.9+ on this machine the job side may meet: on PATH, and under ~/.pyenv."""
    found: dict[str, str] = {}
    candidates = [shutil.which(f"python3.{n}") for n in range(9, 15)]
    candidates += sorted(str(p) for p in (Path.home() / ".pyenv" / "versions").glob("3.*/bin/python3"))
    for c in candidates:
        if not c:
            continue
        res = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30)
        version = res.stdout.strip()
        if res.returncode == 0 and tuple(int(x) for x in version.split(".")) >= (3, 9):
            found.setdefault(version, c)
    if not found:
        found["%d.%d" % sys.version_info[:2]] = sys.executable
    return [pytest.param(found[v], v, id=v) for v in sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))]


@pytest.mark.parametrize(("python", "version"), _pythons())
def test_the_reporter_answers_on_every_python_the_job_side_supports(job: Any, python: str, version: str) -> None:
    j = job("""
        import asyncio, threading, time
        journal_lock = threading.Lock()
        def flush_once():
            journal_lock.acquire()
        t = threading.Thread(target=flush_once, name="flusher")
        t.start()
        t.join()
        def stuck():
            with journal_lock:
                pass
        threading.Thread(target=stuck, name="stuck", daemon=True).start()
        async def main():
            print("ready", flush=True)
            await asyncio.get_running_loop().create_future()
        asyncio.run(main())
    """, python=python)
    r = j.ask()
    assert r["errors"] == [] and r["python"].startswith(version + ".")
    w = thread(r, "stuck")["waits"]
    assert w["kind"] == "lock" and w["expr"] == "journal_lock" and r["locks"][w["id"]]["holders"] == []
    assert r["exited_threads"][0]["target"]["acquires"][0]["id"] == w["id"]
    (loop,) = r["asyncio"]
    (task,) = loop["tasks"]
    assert loop["thread"] == thread(r, "MainThread")["ident"] and task["awaits"]["kind"] == "future"


def test_a_report_of_too_many_deep_threads_is_cut_to_its_caps(job: Any) -> None:
    j = job("""
        import threading, time
        go = threading.Event()
        def deep(n):
            return deep(n - 1) if n else go.wait()
        for i in range(300):
            threading.Thread(target=deep, args=(100,), name=f"deep-{i}", daemon=True).start()
        time.sleep(1.0)
        print("ready", flush=True)
        go.wait()
    """)
    start = time.monotonic()
    r = j.ask()
    took = time.monotonic() - start
    assert len(r["threads"]) == 256 and r["more_threads"] == 301 - 256 and r["truncated"]
    assert all(len(t["frames"]) <= 64 for t in r["threads"]) and r["threads"][0]["main"]
    assert len(json.dumps(r)) <= 2 << 20 and r["cost"]["cpu_s"] < 1.5, r["cost"]
    print(f"300 threads 100 deep: {r['cost']['cpu_s'] * 1000:.0f} ms of CPU, {took * 1000:.0f} ms asked and read")


def test_a_program_that_closes_every_descriptor_never_loses_a_byte_to_the_reporter(job: Any) -> None:
    j = job("""
        import os, time
        time.sleep(0.3)
        os.closerange(3, 1024)  # daemonising: the reporter's FIFO goes, and its numbers are reused
        r, w = os.pipe()
        for fd in range(3, 12):
            try:
                os.fstat(fd)
            except OSError:
                os.dup2(r, fd)  # every low number is now a pipe of the program's
        os.write(w, b"x" * 100)
        time.sleep(0.5)
        print(len(os.read(r, 1000)), flush=True)
        print("ready", flush=True)
        time.sleep(1000)
    """)
    assert j.lines[0] == "100"  # every byte for the program, none read by the reporter's thread
    with pytest.raises(NoReporter):
        j.ask()


def test_the_reporters_fifo_is_never_named_as_what_the_program_waits_on(job: Any) -> None:
    from hangwatchd.host.blocked_on import blocked_on

    j = job("""
        import os, select
        r, w = os.pipe()
        print("ready", flush=True)
        select.select([r], [], [])
    """)
    b = blocked_on(j.proc.pid)
    assert b["syscall"] in ("select", "pselect6", "poll", "ppoll") and b["fds"], b
    assert all("introspect-" not in (d.get("path") or "") for d in b["fds"]) and b["fds"][0]["kind"] == "pipe", b
