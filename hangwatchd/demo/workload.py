"""The demo's workload: a training loop that beats, then waits forever for a peer
that never comes (as a rank does when another rank skipped a collective)."""

from __future__ import annotations

import sys
import threading
import time

import hangwatchd


def train_step(step: int) -> None:
    time.sleep(0.1)


def wait_for_peer() -> None:
    # Stands in for an all_reduce whose peer never arrives: blocks, burns nothing.
    threading.Event().wait()


def main(steps: int) -> None:
    for step in range(steps):
        train_step(step)
        hangwatchd.beat()
    print(f"step {steps}: waiting for a peer that never comes", flush=True)
    wait_for_peer()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
