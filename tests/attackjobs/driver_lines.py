"""A user's own job, under ``hangwatchd run``: the CUDA driver's lines on stderr, then a GPU exception
of its own making (a coredump's ELF header written into its exception FIFO, where it stalls as the
driver does). The launcher keeps the lines in the user's directory of driver logs; the incident
the daemon files for the exception has them.

    python3 driver_lines.py LINES_FILE
"""
import os
import struct
import sys
import threading

sys.stderr.write(open(sys.argv[1]).read())
sys.stderr.flush()
HEADER = bytearray(64)
HEADER[:6] = b"\x7fELF\x02\x01"
struct.pack_into("<HH", HEADER, 16, 4, 190)  # ET_CORE, EM_CUDA: a CUDA coredump's first bytes
fd = os.open(os.environ["CUDA_COREDUMP_FILE"].replace("%p", str(os.getpid())), os.O_WRONLY)
os.write(fd, bytes(HEADER))
threading.Event().wait()  # the driver's thread waits for the daemon to read the rest
