"""Healthy look-alike: a CPU-bound process on a loaded node. ``tokenize_corpus`` hashes text in
pure Python for 40 s in one tight function, while another tenant's process (started by the
runner beside it) takes a core: half the speed, the same few frames at every sample, still
working.

Report: ActivityWatch/activitywatch#773 (a server that "kinda hangs for ~120 secs when it's
getting excess requests" but processes them: slow under load is not hung).
"""

import hashlib
import time

CASE = {
    "title": "CPU-bound work on a loaded node (a CPU hog beside it)",
    "source": "ActivityWatch/activitywatch#773 (slow under load, not hung)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
    "beside": "cpu_hog",
}

RUN_S = 40.0


def tokenize_corpus() -> int:
    # Each step hashes the last digest: the state moves at every step. (A counter advanced by a
    # digest's first byte stops where that byte is 0 - at 20069 - and the loop then computes the
    # same thing for ever: a spin, to any observer.)
    n, digest = 0, b""
    end = time.monotonic() + RUN_S
    while time.monotonic() < end:
        digest = hashlib.sha256(digest + str(n).encode()).digest()
        n += 1
    return n


if __name__ == "__main__":
    tokenize_corpus()
