"""An attacker's own job (``hangwatchd run -- python3 dump_flood.py N MB``): N GPU "exceptions" in a
row, each from a program of its own below it, each writing a CUDA coredump's header that says MB
megabytes, then MB megabytes of random bytes (which no compressor makes smaller) into that program's
exception FIFO. The daemon drains each whole, compresses it and keeps it in an incident. Prints
"flooded N" once every one is written, then beats on."""
import os
import subprocess
import sys
import time

import hangwatchd

n, mb = int(sys.argv[1]), int(sys.argv[2])
WRITER = r"""
import os, struct, sys, time
size = int(sys.argv[2]) << 20
head = bytearray(64)
head[:6] = b"\x7fELF\x02\x01"
struct.pack_into("<HH", head, 16, 4, 190)  # ET_CORE, EM_CUDA
struct.pack_into("<Q", head, 0x28, size - 64)  # its section headers end where the dump does
struct.pack_into("<HH", head, 0x3A, 64, 1)
fifo = sys.argv[1].replace("%p", str(os.getpid()))
while not os.path.exists(fifo):  # made as the program started
    time.sleep(0.01)
fd = os.open(fifo, os.O_WRONLY)
os.write(fd, bytes(head))
left = size - 64
while left:
    left -= os.write(fd, os.urandom(min(left, 1 << 20)))
"""
for _ in range(n):
    subprocess.run([sys.executable, "-c", WRITER, os.environ["CUDA_COREDUMP_FILE"], str(mb)], check=True)
    hangwatchd.beat()
    time.sleep(1)
print(f"flooded {n}", flush=True)
while True:
    hangwatchd.beat()
    time.sleep(0.2)
