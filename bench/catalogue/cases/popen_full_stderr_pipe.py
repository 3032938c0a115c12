"""The classic Popen pipe deadlock: ``collect_output`` starts a child with both stdout and
stderr piped and reads stdout to its end first. The child (``emit_warnings``) writes 1 MiB of
warnings to stderr before its result: the stderr pipe fills (64 KiB), the child blocks in
``write()``, and stdout's end never comes, because the child never finishes.

Reports: zeek/package-manager#198 ("this read() may cause a deadlock as the stdout pipe could
fill ... while the parent process is blocking on this read"); google/turbinia#945;
HewlettPackard/foedus_code#136.
"""

import subprocess
import sys

CASE = {
    "title": "parent reads stdout while the child blocks on a full stderr pipe",
    "source": "zeek/package-manager#198; google/turbinia#945 (stdout=PIPE, stderr=PIPE, one read at a time)",
    "healthy": False,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": ["emit_warnings", "collect_output"],
    "cause": r"full|stderr|write|pipe|deadlock",
    "hangs_after": 1,
}


def emit_warnings() -> None:
    line = "warning: deprecated option --fp16, use --dtype\n"
    for _ in range((1 << 20) // len(line) + 1):
        sys.stderr.write(line)  # blocks once the stderr pipe is full
    sys.stderr.flush()
    print("result: 42")


def collect_output() -> bytes:
    child = subprocess.Popen([sys.executable, __file__, "child"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None
    out = child.stdout.read()  # to EOF, before anyone reads stderr
    child.wait()
    return out


if __name__ == "__main__":
    emit_warnings() if sys.argv[1:] == ["child"] else collect_output()
