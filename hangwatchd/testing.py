"""Test helpers that ship with hangwatchd, so users can test their own setup against it.

- ``ScratchDaemon``: a real ``hangwatchd daemon`` in temporary dirs, with its metrics on a free port.
- ``python -m hangwatchd.testing workload``: a fake watched process that beats, then
  hangs (or exits, or spins) — a real process that really stops beating.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .incidents.store import Store
from .workload import runtime_files

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], seconds: float, what: str = "condition", every: float = 0.05) -> T:
    """``check()``'s first true value, asked every ``every`` seconds; TimeoutError after ``seconds``."""
    end = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"{what} did not happen within {seconds:g} s")
        time.sleep(every)


def stop(*procs: subprocess.Popen[Any], sig: int = signal.SIGTERM, group: bool = False, grace: float = 10.0) -> None:
    """Stop processes a test started, and wait for each: ``sig`` first (to its whole process group
    with ``group``, for a process started with ``start_new_session``), SIGKILL after ``grace`` seconds."""
    def send(p: subprocess.Popen[Any], s: int) -> None:
        try:
            os.killpg(p.pid, s) if group else p.send_signal(s)
        except (ProcessLookupError, PermissionError):
            pass  # gone already (or its group is)

    for p in procs:
        if p.poll() is None:
            send(p, sig)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            send(p, signal.SIGKILL)
            p.wait()


def hangwatchd_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "hangwatchd", *args]


def workload_argv(beats: int = 20, interval: float = 0.05, then: str = "hang") -> list[str]:
    return [sys.executable, "-m", "hangwatchd.testing", "workload", "--beats", str(beats),
            "--interval", str(interval), "--then", then]


class ScratchDaemon:
    """A real daemon process in ``base``; stop it with ``stop()`` or use it as a context manager."""

    def __init__(self, base: Path, *extra: str, env: dict[str, str] | None = None, config: dict[str, Any] | None = None) -> None:
        self.base = Path(base)
        self.state_dir = self.base / "state"
        self.dump_dir = self.base / "state-dumps"  # the default: beside the state dir, never in it
        self.runtime_dir = self.base / "run"
        self.log = self.base / "daemon.log"
        self.base.mkdir(parents=True, exist_ok=True)
        argv = hangwatchd_argv("daemon", "--state-dir", str(self.state_dir), "--runtime-dir", str(self.runtime_dir),
                               "--metrics-address", "127.0.0.1:0", *extra)
        if config:
            cfg = self.base / "hangwatchd.toml"
            cfg.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
            argv += ["--config", str(cfg)]
        full_env = dict(os.environ, **(env or {}))
        self._log = open(self.log, "ab")
        self.proc = subprocess.Popen(argv, stderr=self._log, env=full_env)
        self.info: dict[str, Any] = wait_for(self._ready, 20, "the daemon's start")

    def _ready(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        return runtime_files.daemon_info(self.runtime_dir)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.info['metrics_address']}/metrics"

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one sample on /metrics, matched by name and the given labels: the first
        series listed where several match (``metric_total`` adds them up)."""
        values = self._samples(name, labels)
        return values[0] if values else None

    def metric_total(self, name: str, **labels: str) -> float:
        """The sum of every series of ``name`` with the given labels (0 where there is none)."""
        return sum(self._samples(name, labels))

    def _samples(self, name: str, labels: dict[str, str]) -> list[float]:
        return [float(line.rsplit(" ", 1)[1]) for line in self.scrape().splitlines()
                if (line.startswith(name + "{") or line.startswith(name + " "))
                and all(f'{k}="{v}"' in line for k, v in labels.items())]

    def store(self) -> Store:
        return Store(self.state_dir)

    def event(self, name: str, seconds: float = 10.0, **fields: Any) -> dict[str, Any]:
        """The first log event ``name`` whose fields match, waited for: the loop logs
        ``incident_stored`` when the worker is done, a moment after the incident settled."""
        def found() -> dict[str, Any] | None:
            return next((e for e in self.logs() if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())), None)

        return wait_for(found, seconds, f"a {name} event")

    def passes(self, what: str = "look") -> float:
        """How many passes of this kind the loop has made (``hangwatchd_loop_passes_total``)."""
        return self.metric("hangwatchd_loop_passes_total", what=what) or 0.0

    def looked(self, times: int = 1, what: str = "look", seconds: float = 30.0, after: float | None = None) -> None:
        """Wait until the loop has made ``times`` more passes of this kind from now (or from ``after``, a
        Unix time: when a verdict would have come): what marks that the daemon looked again, where
        nothing else would happen. Never a fixed sleep, which a slow daemon passes without looking."""
        if after is not None:
            wait_for(lambda: time.time() >= after, max(0.0, after - time.time()) + 1.0, "the moment to look after")
        start = self.passes(what)
        wait_for(lambda: self.passes(what) >= start + times, seconds, f"{times} more {what} passes of the loop", every=0.1)

    def settled(self) -> list[dict[str, Any]]:
        """The stored incidents whose evidence is all in: an incident is listed once its stacks are,
        and its flight recorders and GPU dumps are added after (``pending`` counts what is coming)."""
        return [i for i in self.store().list() if not i.get("pending")]

    def run(self, command: Sequence[str], *options: str, **kw: Any) -> subprocess.Popen[bytes]:
        """``hangwatchd run --runtime-dir ... OPTIONS -- COMMAND`` as a child process."""
        return subprocess.Popen(hangwatchd_argv("run", "--runtime-dir", str(self.runtime_dir), *options, "--", *command), **kw)

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def stop(self, sig: int = signal.SIGTERM) -> int:
        stop(self.proc, sig=sig, grace=20)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ScratchDaemon:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


# -- the fake workload -----------------------------------------------------

def hang_here() -> None:
    """Where the fake workload sits once it stops beating: blocked, burning nothing."""
    threading.Event().wait()


def spin_here() -> None:
    while True:
        pass


def _workload(args: argparse.Namespace) -> int:
    import hangwatchd

    if args.register:
        hangwatchd.register(job=args.job, heartbeat_timeout=args.timeout)
    for _ in range(args.beats):
        hangwatchd.beat()
        time.sleep(args.interval)
    print("stopped beating", flush=True)
    if args.then == "exit":
        return 0
    if args.then == "spin":
        spin_here()
    hang_here()
    return 0


def _fifo(path: str) -> int:
    os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)


def _gpu_workload(args: argparse.Namespace) -> int:
    """Plays the CUDA driver's and PyTorch's parts with real FIFOs: a coredump pipe that
    answers with a dump (whole, half, or never), a flight-recorder pipe that answers or not."""
    import lzma
    import pickle
    import select
    import socket

    import hangwatchd

    pid, host = os.getpid(), socket.gethostname()
    rank = os.environ.get("RANK", "0")

    def moment(what: str) -> None:
        if args.moments:
            with open(args.moments, "a") as f:
                f.write(f"{what} {time.time()}\n")

    imported = threading.Lock()  # held through PyTorch's first dump with entries, which imports torch._inductor once
    started = time.monotonic()

    def write_trace(first_delay: list[float]) -> None:
        has_entries = time.monotonic() - started >= args.fr_entries_after
        with imported:
            if has_entries and first_delay:
                time.sleep(first_delay.pop())
                moment("fr-imported")
        time.sleep(args.fr_delay)
        # as PyTorch 2.11 does: the new name first, the old one before it
        out = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]) + rank
        entries = [{"record_id": 0, "profiling_name": "nccl:all_gather",
                    "frames": [{"name": "train_step", "filename": "train.py", "line": 42}]}] if has_entries else []
        with open(out, "wb") as f:
            pickle.dump({"version": "2.4", "pg_status": {}, "entries": entries}, f)
        moment("fr-written" if entries else "fr-written-empty")

    def serve_flight_recorder(fd: int) -> None:
        """PyTorch's dump thread: every request is answered on a thread of its own, from the start."""
        first_delay = [args.fr_first_delay]
        while True:
            select.select([fd], [], [], 3600)
            if not os.read(fd, 4096):
                time.sleep(0.05)  # no writer: wait for the next
                continue
            moment("fr-asked")
            if args.fr == "answer":
                threading.Thread(target=write_trace, args=(first_delay,), daemon=True).start()

    _device = open(args.hold_device, "rb") if args.hold_device else None  # held for life
    cuda_fd = fr_fd = None
    if args.cuda != "none":
        cuda_fd = _fifo(os.environ["CUDA_COREDUMP_PIPE"].replace("%p", str(pid)).replace("%h", host))
    if args.fr != "none":
        fr_fd = _fifo(os.environ["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] + rank + ".pipe")
        threading.Thread(target=serve_flight_recorder, args=(fr_fd,), daemon=True).start()
    for _ in range(args.beats):
        hangwatchd.beat()
        time.sleep(args.interval)
    print("stopped beating", flush=True)
    moment("stopped-beating")
    while True:
        if cuda_fd is None:
            time.sleep(3600)
            continue
        select.select([cuda_fd], [], [], 3600)
        if not os.read(cuda_fd, 4096):
            time.sleep(0.05)  # the writer closed; wait for the next
            continue
        moment("cuda-asked")
        if args.cuda in ("dump", "half"):
            time.sleep(args.dump_delay)
            blob = lzma.decompress(Path(args.dump).read_bytes())
            out = os.environ["CUDA_COREDUMP_FILE"].replace("%h", host).replace("%p", str(pid)).replace("%t", str(int(time.time())))
            print(f"[00:00:00.000000] coredump: Writing ELF file to {out}", file=sys.stderr, flush=True)
            f = open(out, "wb")
            third = len(blob) // 3
            for i in range(3):
                if args.cuda == "half" and i == 1:
                    f.flush()
                    time.sleep(3600)  # a driver that stops half way, file still open
                f.write(blob[i * third : (i + 1) * third if i < 2 else len(blob)])
                f.flush()
                time.sleep(0.2)
            f.close()
            print("[00:00:00.000000] coredump: All done (took 00s)", file=sys.stderr, flush=True)
            os._exit(134)  # a user-triggered dump ends the process (SIGABRT)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hangwatchd.testing")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("workload", help="beat, then hang, exit or spin")
    w.add_argument("--beats", type=int, default=20)
    w.add_argument("--interval", type=float, default=0.05)
    w.add_argument("--then", choices=["hang", "exit", "spin"], default="hang")
    w.add_argument("--register", action="store_true", help="register itself (hangwatchd.register())")
    w.add_argument("--job")
    w.add_argument("--timeout", type=float)
    g = sub.add_parser("gpu-workload", help="beat, then hang holding CUDA and flight-recorder FIFOs")
    g.add_argument("--beats", type=int, default=10)
    g.add_argument("--interval", type=float, default=0.05)
    g.add_argument("--cuda", choices=["dump", "half", "ignore", "none"], default="dump")
    g.add_argument("--fr", choices=["answer", "silent", "none"], default="answer")
    g.add_argument("--dump", help="the .nvcudmp.xz to answer with")
    g.add_argument("--fr-delay", type=float, default=0.0,
                   help="seconds between reading the flight-recorder pipe and writing the trace, on a thread of its "
                        "own (PyTorch 2.11 took 3.4 to 4.4 s on an H200)")
    g.add_argument("--fr-first-delay", type=float, default=0.0,
                   help="seconds more for the first trace with entries only (PyTorch 2.11 imports torch._inductor to "
                        "name their frames: 3.4 to 7 s on an H200 in eager mode); a request meanwhile waits for it too")
    g.add_argument("--fr-entries-after", type=float, default=0.0,
                   help="seconds after its start before its trace has entries (its first collective); an empty trace "
                        "is written at once")
    g.add_argument("--moments", help="append 'WHAT TIME' lines here: fr-asked, fr-imported, fr-written(-empty), stopped-beating, cuda-asked")
    g.add_argument("--dump-delay", type=float, default=0.0,
                   help="seconds between reading the coredump pipe and creating the dump file (the driver collecting "
                        "the GPU's state)")
    g.add_argument("--hold-device", help="a file to hold open for life, as CUDA holds /dev/nvidiaN")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return _gpu_workload(args) if args.cmd == "gpu-workload" else _workload(args)


if __name__ == "__main__":
    sys.exit(main())
