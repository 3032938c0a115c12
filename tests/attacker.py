"""A hostile local user's side of tests/test_security.py: run as an unprivileged user with the
system's Python (standard library only; it needs nothing of hangwatchd's to attack it).

    python3 attacker.py register RUNTIME_DIR [--pid PID] [--timeout S] [--status] [--no-beat]
        [--beat-path PATH] [--status-path PATH] [--job NAME]

registers PID (itself by default) the way a workload does, writing the registration,
beat segment and status file by hand, prints "registered PID" and then beats every
0.1 s until killed (``--no-beat``: only sleeps). Registering another process than
itself is the attack: the daemon must refuse it. ``--beat-path``/``--status-path``
name those files in the registration as given (a beat segment is made there when
the path leads anywhere the attacker may write; otherwise the name alone is the attack).

``--fr DIR`` holds a flight-recorder FIFO as PyTorch does (DIR/fr_0.pipe; start it with
TORCH_NCCL_DEBUG_INFO_PIPE_FILE=DIR/fr_ and TORCH_FR_DUMP_TEMP_FILE=DIR/trace_) and, each time
something is written into it, answers with the bytes of ``--fr-answer FILE`` as DIR/trace_0.
``--fr-swap FILE`` puts a read-only descriptor of FILE under the FIFO's descriptor number the
moment DIR is opened by anyone (inotify), the daemon's look at the trace's directory just
before it writes to the FIFO, and the FIFO back a second later.
``--launcher PID`` and ``--on-hang abort`` claim those fields in the registration.

``--bait DIR`` makes it look like a hung GPU process to anything that reads names:
it holds FIFOs named like a CUDA coredump pipe and a flight-recorder pipe (made
in DIR; start it with TORCH_NCCL_DEBUG_INFO_PIPE_FILE=DIR/fr_ in its
environment), beats five times and then sleeps for good in a Python function
named ``cuStreamSynchronize``.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time


def start_time(pid: int) -> int:
    raw = open(f"/proc/{pid}/stat", "rb").read()
    return int(raw[raw.rfind(b")") + 2:].split()[19])


def register(args: argparse.Namespace) -> int:
    pid = args.pid or os.getpid()
    start = start_time(pid)
    beats = os.path.join(args.runtime_dir, "beats")
    beat = args.beat_path or os.path.join(beats, f"evil-{os.getpid()}-{pid}.beat")
    try:
        with open(beat, "wb") as f:
            f.write(struct.pack("<4sII", b"HWB1", 1, pid) + bytes(64 - 12))
    except OSError:
        pass  # someone else's file: named, not written
    held = []
    if args.bait:
        fr = os.environ.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", os.path.join(args.bait, "fr_")) + "0.pipe"
        for fifo in (os.path.join(args.bait, f"corepipe.{pid}"), fr):
            os.mkfifo(fifo)
            held.append(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    if args.fr:
        import threading
        threading.Thread(target=flight_recorder, args=(args,), daemon=True).start()
    data = {"version": 1, "pid": pid, "start_time": start, "heartbeat_timeout": args.timeout,
            "stack_timeout": args.stack_timeout, "beat_file": None if args.no_beat_file else beat,
            "job": args.job or f"evil-{pid}", "cmdline": ["attacker"], "source": "run", "registered_at": time.time()}
    if args.launcher:
        data["launcher"] = args.launcher
    if args.on_hang:
        data["on_hang"] = args.on_hang
    if args.status_path:
        data["status_file"] = args.status_path
    elif args.status:
        data["status_file"] = beat[: -len(".beat")] + ".status"
        with open(data["status_file"], "w") as f:
            f.write("training, step 1")
    regs = os.path.join(args.runtime_dir, "registrations")
    tmp = os.path.join(regs, f".evil-{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(regs, f"{pid}-{start}.json"))
    print("registered", pid, beat, data.get("status_file", ""), flush=True)
    try:
        fd = os.open(beat, os.O_RDWR)
    except OSError:
        fd = -1
    count = 0
    while True:
        if args.bait and count == 5:  # a few beats, then "hung" where a GPU wait would be
            cuStreamSynchronize()
        if not args.no_beat and (args.beats is None or count < args.beats):
            count += 1
            try:
                os.pwrite(fd, struct.pack("<QQ", count, time.monotonic_ns()), 16)
            except OSError:
                pass
        time.sleep(0.1)


def flight_recorder(args: argparse.Namespace) -> None:
    """PyTorch's side of the flight recorder's FIFO, played by the attacker (see --fr)."""
    import ctypes
    import select

    pipe = os.path.join(args.fr, "fr_0.pipe")
    os.mkfifo(pipe)
    fifo = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init1(os.O_NONBLOCK)
    libc.inotify_add_watch(watch, args.fr.encode(), 0x20)  # IN_OPEN: the directory itself opened
    planted = os.open(args.fr_swap, os.O_RDONLY) if args.fr_swap else -1
    swapped_at = 0.0
    while True:
        ready = select.select([watch, fifo], [], [], 0.2)[0]
        if watch in ready:
            try:
                os.read(watch, 65536)
            except BlockingIOError:
                pass
            if planted >= 0 and not swapped_at:
                os.dup2(planted, fifo)  # the FIFO's number now names a file of root's, open read-only
                swapped_at = time.monotonic()
                print("swapped", flush=True)
        if swapped_at and time.monotonic() - swapped_at > 1.0:
            os.dup2(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK), fifo)  # the FIFO back, for the next try
            swapped_at = 0.0
        if fifo in ready and not swapped_at:
            try:
                asked = os.read(fifo, 128)
            except BlockingIOError:
                asked = b""
            if asked and args.fr_answer:
                tmp = os.path.join(args.fr, ".trace")
                with open(args.fr_answer, "rb") as src, open(tmp, "wb") as out:
                    out.write(src.read())
                os.rename(tmp, os.path.join(args.fr, "trace_0"))
                print("answered", flush=True)


def cuStreamSynchronize() -> None:  # named like the driver's call, which it is not
    while True:
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("register")
    r.add_argument("runtime_dir")
    r.add_argument("--pid", type=int)
    r.add_argument("--timeout", type=float, default=3.0)
    r.add_argument("--stack-timeout", type=float)
    r.add_argument("--status", action="store_true")
    r.add_argument("--no-beat", action="store_true")
    r.add_argument("--beats", type=int, help="beat this many times, then no more (a hang)")
    r.add_argument("--no-beat-file", action="store_true", help="watched by its stack alone")
    r.add_argument("--beat-path", help="the beat file named in the registration")
    r.add_argument("--status-path", help="the status file named in the registration")
    r.add_argument("--job", help="the job name claimed")
    r.add_argument("--fr", metavar="DIR", help="hold a flight-recorder FIFO in DIR and answer it (see above)")
    r.add_argument("--fr-answer", metavar="FILE", help="the trace handed back when asked")
    r.add_argument("--fr-swap", metavar="FILE", help="a file put under the FIFO's descriptor as DIR is opened")
    r.add_argument("--launcher", type=int, help="the launcher pid claimed")
    r.add_argument("--on-hang", choices=("report", "abort"), help="the policy claimed")
    r.add_argument("--bait", metavar="DIR", help="hold FIFOs named like CUDA's and PyTorch's, sleep in cuStreamSynchronize")
    args = p.parse_args()
    return register(args)


if __name__ == "__main__":
    sys.exit(main())
