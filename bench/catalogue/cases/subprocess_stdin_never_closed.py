"""A child waits for end-of-input that its parent never sends: ``run_counter`` starts a child
with ``stdin=PIPE``, writes the records, flushes, and calls ``wait()`` without closing stdin.
The child (``count_lines``) reads stdin to EOF; the parent still holds the write end open
while it waits for the child to exit. Each waits for the other.

Reports: localstack/localstack#1101 ("Fix subprocess.wait() hanging", Popen with stdin=PIPE
and wait()); zeek/package-manager#198 (Popen used in a way that may deadlock).
"""

import subprocess
import sys

CASE = {
    "title": "subprocess waits for stdin EOF the parent never closes",
    "source": "localstack/localstack#1101; zeek/package-manager#198 (Popen pipes and wait())",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["count_lines", "run_counter"],
    "cause": r"stdin|EOF|never clos|pipe|deadlock",
    "hangs_after": 1,
}


def count_lines() -> None:
    n = sum(1 for _ in sys.stdin)  # ends at EOF, which never comes
    print(n)


def run_counter() -> int:
    child = subprocess.Popen([sys.executable, __file__, "child"], stdin=subprocess.PIPE)
    assert child.stdin is not None
    child.stdin.write(b"a\nb\nc\n")
    child.stdin.flush()  # but no close(): the child never sees EOF
    return child.wait()


if __name__ == "__main__":
    count_lines() if sys.argv[1:] == ["child"] else run_counter()
