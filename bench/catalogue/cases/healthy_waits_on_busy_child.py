"""Healthy look-alike: a parent waits for a busy child. ``build_extension`` runs a compiler-like
child process (``compile_units``: 40 s of CPU work) with ``subprocess.run``; the parent's stack
is one ``wait`` the whole time, the child's work moves.

Report: pytorch/pytorch#75147 (a parent waiting on its children: stuck child, or one still
working?).
"""

import subprocess
import sys
import time

CASE = {
    "title": "parent waits on a child that is busy compiling (40 s)",
    "source": "pytorch/pytorch#75147 (waiting on children that still work)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}


def compile_units() -> None:
    end = time.monotonic() + 40.0
    while time.monotonic() < end:
        compile("x = [i * i for i in range(1000)]\n" * 200, "<unit>", "exec")


def build_extension() -> None:
    subprocess.run([sys.executable, __file__, "child"], check=True)


if __name__ == "__main__":
    compile_units() if sys.argv[1:] == ["child"] else build_extension()
