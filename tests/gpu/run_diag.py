"""Why issue 21's two device misses happen, measured without the daemon in the way.

    PYTHONPATH=/tmp/site:. python3 tests/gpu/run_diag.py OUTDIR [DUMPDIR] [--only-fr]

1. flight recorder: one rank with a one-rank NCCL group stops beating; its flight-recorder
   pipe is written 1.5 s later and the trace file is timed (appeared, complete), with the
   rank's PyTorch INFO log. Three ways: the kernel spinning with the host in
   cudaDeviceSynchronize; the host sleeping with the GPU idle; spinning with
   TORCH_NCCL_COORD_CHECK_MILSEC=100. A trace not complete in 15 s: py-spy --native of
   every thread says where PyTorch's dump waits. Then the GPU dump is triggered and timed.
2. eight dumps at once: 8 spinning processes on the one GPU, every coredump pipe written
   at the same moment (one byte each, as the daemon does). After 2 s: which dumps began
   (the driver's "Starting GPU coredump generation"), and for the others whether the byte
   is still unread in the FIFO; those are written again and followed 8 s more. Twice.
3. big dumps: ranks that ran many kinds of kernel first (many modules, a big dump), dumped
   through the pipe and kept under OUTDIR's scratch for bench/symbolize.py.

--only-fr: the flight recorder alone, with the GPU idle: py-spy of every thread 1, 2 and 3 s
after the request (where PyTorch spends its seconds), then again plain and with each of
TORCH_SYMBOLIZE_MODE=fast and dladdr.

Writes OUTDIR/diag.json and every rank's log. The environment is the one `hangwatchd run`
gives a workload (launcher.workload_env). Every process started is killed by process group.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hangwatchd.host import procfs  # noqa: E402
from hangwatchd.host.pyspy_binary import find_pyspy  # noqa: E402
from hangwatchd.testing import stop, wait_for  # noqa: E402
from hangwatchd.workload.launcher import workload_env  # noqa: E402

RANK = [sys.executable, str(ROOT / "tests/gpu/fast_rank.py")]


class Rank:
    def __init__(self, base: Path, name: str, args: list[str], extra: dict[str, str], out: Path) -> None:
        self.name = name
        run, dumps = base / name / "run", base / name / "dumps"
        (run / "pipes").mkdir(parents=True)
        dumps.mkdir(parents=True)
        self.dumps = dumps
        self.env = workload_env(dict(os.environ), run, dumps, name)
        self.env.update(extra, RANK=extra.get("RANK", "0"), LOCAL_RANK="0", WORLD_SIZE="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.log = out / f"{name}.log"
        self.logf = open(self.log, "wb")
        self.proc = subprocess.Popen(RANK + args, env=self.env, stdout=self.logf, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stalled(self) -> bool:
        return "STALL" in self.text()

    def fifo(self, prefix: str) -> int | None:
        return next((fd for fd, path, _ in procfs.held_fifos(self.proc.pid) if os.path.basename(path).startswith(prefix)),
                    None)

    def poke(self, prefix: str, data: bytes) -> str:
        fd = self.fifo(prefix)
        if fd is None:
            return f"no FIFO {prefix}*"
        try:
            procfs.poke_fifo(self.proc.pid, fd, data)
            return "written"
        except OSError as exc:
            return f"{exc.strerror}"

    def unread(self, prefix: str) -> int | None:
        """Bytes waiting in the FIFO (FIONREAD through our own read end of the same object)."""
        fd = self.fifo(prefix)
        if fd is None:
            return None
        r = os.open(f"/proc/{self.proc.pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
        try:
            return struct.unpack("i", fcntl.ioctl(r, termios.FIONREAD, b"\0\0\0\0"))[0]
        finally:
            os.close(r)

    def dump_files(self) -> list[Path]:
        return sorted(self.dumps.glob("*.nvcudmp"))

    def end(self) -> None:
        stop(self.proc, sig=signal.SIGKILL, group=True)
        self.logf.close()


def pyspy_threads(pid: int, out: Path) -> list[dict[str, Any]]:
    tool = find_pyspy()
    if not tool:
        return [{"error": "no py-spy"}]
    r = subprocess.run([tool, "dump", "--native", "--json", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    out.write_text(r.stdout + r.stderr)
    try:
        return [{"thread": t.get("thread_name"), "tid": t.get("os_thread_id"), "gil": t.get("owns_gil"),
                 "top": [f["name"] for f in t["frames"][:14]]} for t in json.loads(r.stdout)]
    except ValueError:
        return [{"error": r.stderr[-500:]}]


def flight_recorder(base: Path, out: Path, name: str, hang: str, extra: dict[str, str], sample: bool = False) -> dict[str, Any]:
    rank = Rank(base, name, ["--fr", "--hang", hang], dict(extra, TORCH_CPP_LOG_LEVEL="INFO"), out)
    res: dict[str, Any] = {"hang": hang, "extra": extra}
    try:
        wait_for(rank.stalled, 180, f"{name} stalled", every=0.05)
        time.sleep(1.5)
        trace = Path(rank.env["TORCH_FR_DUMP_TEMP_FILE"] + "0")
        t0 = time.monotonic()
        res["poke"] = rank.poke("nccl_trace_", b"1")
        appeared = complete = None
        last = (-1, 0.0)
        samples = [1.0, 2.0, 3.0] if sample else []
        while time.monotonic() - t0 < 15:
            if samples and time.monotonic() - t0 >= samples[0] and appeared is None:
                at = samples.pop(0)
                res.setdefault("samples", {})[at] = [t for t in pyspy_threads(rank.proc.pid, out / f"{name}-at{at:g}.json")
                                                     if t.get("thread") != "MainThread"]
            if trace.exists():
                appeared = appeared or time.monotonic() - t0
                size = trace.stat().st_size
                if size != last[0]:
                    last = (size, time.monotonic())
                elif size > 0 and time.monotonic() - last[1] > 0.3:
                    complete = last[1] - t0
                    break
            time.sleep(0.01)
        res.update(appeared_s=appeared, complete_s=complete, trace_bytes=last[0])
        if complete is None:
            res["threads"] = pyspy_threads(rank.proc.pid, out / f"{name}-pyspy.json")
        t1 = time.monotonic()
        res["dump_poke"] = rank.poke("cuda_pipe", b"\0")
        got = wait_for(lambda: rank.proc.poll() is not None and rank.dump_files(), 60, "the dump", every=0.02) \
            if res["dump_poke"] == "written" else []
        res["dump_s"] = round(time.monotonic() - t1, 3)
        res["dump_bytes"] = got[0].stat().st_size if got else None
        res["log_lines"] = [ln for ln in rank.text().splitlines() if "coredump: SM" not in ln][-40:]
    except Exception as exc:  # noqa: BLE001 - the next measurement still runs
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        rank.end()
    return res


def eight(base: Path, out: Path, trial: int) -> dict[str, Any]:
    barrier = base / f"barrier{trial}"
    barrier.mkdir()
    ranks = [Rank(base, f"eight{trial}-r{r}", [], {"FAST_BARRIER_DIR": str(barrier), "FAST_RANKS": "8", "RANK": str(r)}, out)
             for r in range(8)]
    res: dict[str, Any] = {}
    try:
        wait_for(lambda: all(r.stalled() for r in ranks), 240, "8 ranks stalled", every=0.05)
        time.sleep(1.0)
        pokes = [r.poke("cuda_pipe", b"\0") for r in ranks]  # as close together as Python goes
        t0 = time.monotonic()
        time.sleep(2.0)
        began = ["Starting GPU coredump generation" in r.text() for r in ranks]
        unread = [r.unread("cuda_pipe") if not b else None for r, b in zip(ranks, began)]
        alive = [r.proc.poll() is None for r in ranks]
        again = [r.poke("cuda_pipe", b"\0") if not b else None for r, b in zip(ranks, began)]
        t1 = time.monotonic()
        deadline = t1 + 8
        while time.monotonic() < deadline and not all(r.dump_files() for r in ranks):
            time.sleep(0.05)
        res = {"pokes": pokes, "began_within_2s": began, "unread_bytes_when_not_begun": unread, "alive_at_2s": alive,
               "poked_again": again, "dumps_at_end": [len(r.dump_files()) for r in ranks],
               "began_at_end": ["Starting GPU coredump generation" in r.text() for r in ranks],
               "seconds_after_second_poke": round(time.monotonic() - t1, 2), "first_poke_to_2s": round(t1 - t0, 2)}
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for r in ranks:
            r.end()
    return res


def big(base: Path, out: Path, name: str, extra: dict[str, str], keep: Path) -> dict[str, Any]:
    rank = Rank(base, name, ["--many-kernels"], extra, out)
    res: dict[str, Any] = {"extra": extra}
    try:
        wait_for(rank.stalled, 240, f"{name} stalled", every=0.05)
        time.sleep(1.0)
        t0 = time.monotonic()
        res["poke"] = rank.poke("cuda_pipe", b"\0")
        got = wait_for(lambda: rank.proc.poll() is not None and rank.dump_files(), 120, "the dump", every=0.05)
        res["dump_s"] = round(time.monotonic() - t0, 3)
        dest = keep / f"{name}.nvcudmp"
        got[0].rename(dest)
        res["dump"] = str(dest)
        res["dump_mb"] = round(dest.stat().st_size / 1e6, 1)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        rank.end()
    return res


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0])
    keep = Path(args[1]) if len(args) > 1 else out / "dumps"
    out.mkdir(parents=True, exist_ok=True)
    keep.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="hangwatchd-diag-"))
    report: dict[str, Any] = {}
    if "--only-fr" in sys.argv:  # where PyTorch's flight recorder spends its seconds
        runs = {"fr_sampled": ("sleep", {}, True), "fr_again": ("sleep", {}, False),
                "fr_fast_symbols": ("sleep", {"TORCH_SYMBOLIZE_MODE": "fast"}, False),
                "fr_dladdr": ("sleep", {"TORCH_SYMBOLIZE_MODE": "dladdr"}, False)}
        for k, (hang, extra, sample) in runs.items():
            report[k] = r = flight_recorder(base, out, k, hang, extra, sample)
            print(f"== {k}: appeared {r.get('appeared_s')} complete {r.get('complete_s')} {r.get('error', '')}", flush=True)
            for at, threads in r.get("samples", {}).items():
                for t in threads:
                    print(f"   at {at} s: {t.get('thread')} gil={t.get('gil')} {' < '.join(map(str, t.get('top', [])[:10]))}")
        (out / "diag.json").write_text(json.dumps(report, indent=1, default=str))
        return 0
    report["fr_spin"] = flight_recorder(base, out, "fr_spin", "spin", {})
    report["fr_sleep"] = flight_recorder(base, out, "fr_sleep", "sleep", {})
    report["fr_spin_100ms"] = flight_recorder(base, out, "fr_spin_100ms", "spin", {"TORCH_NCCL_COORD_CHECK_MILSEC": "100"})
    for k in ("fr_spin", "fr_sleep", "fr_spin_100ms"):
        r = report[k]
        print(f"== {k}: poke {r.get('poke')} appeared {r.get('appeared_s')} complete {r.get('complete_s')} "
              f"bytes {r.get('trace_bytes')} dump {r.get('dump_s')} s {r.get('error', '')}", flush=True)
    for trial in (1, 2):
        report[f"eight{trial}"] = r = eight(base, out, trial)
        print(f"== eight{trial}: {json.dumps(r)}", flush=True)
    report["big_lazy"] = big(base, out, "big_lazy", {}, keep)
    report["big_eager"] = big(base, out, "big_eager", {"CUDA_MODULE_LOADING": "EAGER"}, keep)
    for k in ("big_lazy", "big_eager"):
        print(f"== {k}: {json.dumps(report[k])}", flush=True)
    (out / "diag.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
