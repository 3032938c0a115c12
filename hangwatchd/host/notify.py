"""systemd's notify protocol: one datagram to $NOTIFY_SOCKET. No library needed."""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send e.g. "READY=1" or "WATCHDOG=1"; False when not run by systemd (or the socket is gone)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(1.0)
            s.sendto(message.encode(), address)
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Half of $WATCHDOG_USEC in seconds, when systemd asked for pings (and they are for us)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
