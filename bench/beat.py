"""The cost of one ``hangwatchd.beat()`` against an sd_notify-style AF_UNIX datagram
("WATCHDOG=1") sent from the same process, both measured in this run.

Target: at most 300 ns a beat on the 2-core CI machine, at least 10x cheaper than the datagram.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _figures import Figure, report

N = 200_000


def best(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        seg = os.path.join(tmp, "bench.beat")
        from hangwatchd.workload import beat_segment

        beat_segment.create(seg, os.getpid())
        os.environ["HANGWATCHD_BEAT_FILE"] = seg
        import hangwatchd

        hangwatchd.beat()
        beat_s = best(hangwatchd.beat, N)

        os.environ.pop("HANGWATCHD_BEAT_FILE")
        from hangwatchd.workload import client

        client._reset_after_fork()  # as in a process nobody launched or registered
        hangwatchd.beat()
        idle_s = best(hangwatchd.beat, N)

        path = os.path.join(tmp, "notify.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        server.bind(path)
        # A reader like systemd's, in another process, so the queue never fills.
        reader = os.fork()
        if reader == 0:
            while server.recv(64) != b"STOP":
                pass
            os._exit(0)
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        msg = b"WATCHDOG=1"

        def notify() -> None:
            # As sd_notify(3) does: sendmsg to $NOTIFY_SOCKET's address (its socket is made
            # once here, which only flatters the datagram).
            sender.sendto(msg, path)

        dgram_s = best(notify, N // 10)
        sender.sendto(b"STOP", path)
        os.waitpid(reader, 0)

    ratio = dgram_s / beat_s
    report("beat", [
        Figure("one hangwatchd.beat()", f"{beat_s * 1e9:.0f} ns", f"AF_UNIX datagram (sd_notify): {dgram_s * 1e9:.0f} ns",
               "at most 300 ns", beat_s <= 300e-9),
        Figure("beat / datagram", f"{ratio:.1f}x cheaper", "the datagram", "at least 10x", ratio >= 10),
        Figure("beat() in a process nobody watches", f"{idle_s * 1e9:.0f} ns", "-", "", None),
    ])

if __name__ == "__main__":
    main()
