"""Healthy look-alike watched by its stack: an event loop of one thread that waits in
``select`` (one second at most) for commands on a pipe that stays quiet, and beats at every
turn. Every sample lands in the same ``select``: the stack never moves, and there is no
listening socket to show it idle. Its beats, from that one thread, say the loop turns.

Report: suzuke/AgEnD#97 (a hang detector that flagged idle, healthy instances as hung: 73 %
of its alarms were false; quiet with nothing pending is not hung).
"""

import os
import selectors

import hangwatchd

CASE = {
    "title": "a one-thread loop that polls a quiet pipe and beats at every turn",
    "source": "suzuke/AgEnD#97 (idle instances flagged as hung)",
    "healthy": True,
    "watch": {"stack_timeout": 5},
    "ranks": 1,
    "culprit": [],
    "cause": r"",
    "hangs_after": 0.5,
    "observe": 25,
}


def command_loop() -> None:
    commands, _keep = os.pipe()  # the write end is kept, and nothing is written
    sel = selectors.DefaultSelector()
    sel.register(commands, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select(timeout=1.0):
            os.read(key.fd, 4096)
        hangwatchd.beat()


if __name__ == "__main__":
    command_loop()
