"""Healthy look-alike watched by its beats: a training loop whose steps take 1 to 2 s (a heavy
model on a small machine) and that beats once per step, with a 3 s heartbeat timeout. The gaps
between beats are long, but always shorter than the timeout.

Report: huggingface/accelerate#314 ("Timeout when use Multi-gpu training": slow steps at an
epoch's start judged as a hang by a timeout).
"""

import time

import hangwatchd

CASE = {
    "title": "slow steps (1-2 s) that beat within a 3 s heartbeat timeout",
    "source": "huggingface/accelerate#314 (slow is not hung when the beats keep coming)",
    "healthy": True,
    "watch": {"heartbeat_timeout": 3},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}


def step(i: int) -> None:
    time.sleep(1.0 + (i % 3) * 0.5)


if __name__ == "__main__":
    for i in range(40):
        step(i)
        hangwatchd.beat()
