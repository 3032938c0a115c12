"""Is a process whose stack holds still working, or waiting for work? Then it is not hung.

The frozen-stack detector sees one stack over its window; this judges the window
by what the process did meanwhile (``host.activity``: counters it cannot move
while it waits) and by what a server has waiting for it:

- it moved data: it read or wrote (a consumer got its items, a checkpoint
  went to disk);
- its children computed, or wanted to on a loaded node (a build, a tokenizer pool);
- it wanted CPU while none of its Python threads ran: the library's own
  threads work (a gloo all-reduce, BLAS, a tokenizer's Rust threads), judged by
  the CPU it had *and* the CPU it waited for on a loaded node, not by a fixed
  share of a core. A Python thread that burns the CPU at one line with the same
  locals is a spin: that proves nothing, and is not excused here;
- it serves and nothing waits: its listening sockets hold no connection and
  its sockets no unread byte, while it waits in accept, select or epoll.

Each answer is a sentence for the log and the status; None means the stack's
stillness stands.
"""

from __future__ import annotations

from typing import Any

from ..host.activity import Activity

# A wake-up byte on an event pipe (or an eventfd's 8) is not work; an item, however small, is: a small
# int through a multiprocessing queue is 9 bytes read (a 4-byte length and its pickle), and a slow
# pipeline's consumer may get one in a window.
MIN_IO_BYTES = 9
MIN_KIDS_SHARE = 0.2  # cores its children used over the window
MIN_DEMAND = 0.5  # cores it wanted (had + waited for), with no Python thread of its own running


def progress(first: Activity | None, last: Activity | None, python_running: bool) -> str | None:
    """Why the process worked between two looks, or None: see the module's text."""
    if first is None or last is None:
        return None
    span = last.time - first.time
    if span <= 0:
        return None
    if first.io_bytes is not None and last.io_bytes is not None and last.io_bytes - first.io_bytes >= MIN_IO_BYTES:
        return f"it read or wrote {last.io_bytes - first.io_bytes} bytes in {span:.0f} s"
    # What its children wanted: the CPU they had and, on a loaded node, the CPU they waited for.
    kids = (last.kids_cpu_ns - first.kids_cpu_ns) / 1e9 / span
    kids_waited = max(0, last.kids_wait_ns - first.kids_wait_ns) / 1e9 / span
    if last.kids and kids + kids_waited >= MIN_KIDS_SHARE:
        return (f"its child processes used {kids:.1f} cores over {span:.0f} s"
                + (f" and waited {kids_waited:.1f} for a CPU" if kids_waited >= 0.05 else ""))
    if python_running or None in (first.cpu_ns, last.cpu_ns, first.wait_ns, last.wait_ns):
        return None
    had = (last.cpu_ns - first.cpu_ns) / 1e9 / span  # type: ignore[operator]
    waited = (last.wait_ns - first.wait_ns) / 1e9 / span  # type: ignore[operator]
    if had + waited >= MIN_DEMAND:
        return (f"its non-Python threads wanted {had + waited:.1f} cores over {span:.0f} s (had {had:.1f}, waited "
                f"{waited:.1f} for a CPU), while none of its Python threads ran")
    return None


def idle_server(io: dict[str, Any] | None, waiting_for_work: bool) -> str | None:
    """A server with nothing to do: it waits where servers wait for work, and no connection waits in
    its listening sockets' backlogs and no byte in its sockets; None otherwise (it has work waiting,
    or it is no server)."""
    if not waiting_for_work or not isinstance(io, dict) or not io.get("complete", True):
        return None
    listening = [x for x in io.get("listening") or [] if isinstance(x, dict)]
    unread = [x for x in io.get("unread") or [] if isinstance(x, dict)]
    if not listening or unread or any((x.get("backlog") or 0) > 0 for x in listening):
        return None
    return (f"it waits for work and has none: {len(listening)} listening socket{'s' if len(listening) != 1 else ''} "
            "with no connection waiting, no unread bytes")


def work_waiting(io: dict[str, Any] | None) -> str | None:
    """What a hung server had waiting for it, for the incident: connections in its backlogs, unread bytes."""
    if not isinstance(io, dict):
        return None
    pending = sum(int(x.get("backlog") or 0) for x in io.get("listening") or [] if isinstance(x, dict))
    unread = [x for x in io.get("unread") or [] if isinstance(x, dict)]
    parts = []
    if pending:
        parts.append(f"{pending} connection{'s' if pending != 1 else ''} waiting to be accepted")
    if unread:
        parts.append(f"{sum(int(x.get('rx_queue') or 0) for x in unread)} unread bytes on {len(unread)} socket"
                     f"{'s' if len(unread) != 1 else ''}")
    return ", ".join(parts) or None
