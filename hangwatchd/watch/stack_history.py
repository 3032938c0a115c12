"""Stack samples of a watched process and the run of them that share one stack."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..host.activity import Activity
from ..workload.introspect.reporter import is_reporter_thread

KEEP = 32  # samples of a run kept: its first (when it started) and the latest (how it goes); an idle process holds one stack for days


@dataclass(frozen=True)
class Sample:
    time: float  # monotonic
    signature: tuple[tuple[tuple[str, str, int], ...], ...]
    frames: tuple[str, ...]  # every frame name, for the pattern checks
    cpu_seconds: float | None  # all threads, so far
    ctx_switches: int | None
    error: str | None = None
    refused: bool = False  # not taken: the process is no longer its registered user's alone
    activity: Activity | None = None  # its counters at the sample (CPU had and waited for, bytes moved, children's CPU)
    python_running: bool = False  # py-spy saw one of its Python threads on a CPU
    locals_digest: int | None = None  # the program's threads' local variables, hashed: they change while it computes
    io: dict[str, Any] | None = None  # the native look's: its listening sockets and unread bytes (a server with work?)
    main: str | None = None  # what its main thread was doing (detect.pace: collective, input, gpu, running, waiting)
    main_at: tuple[str, ...] = ()  # and the program's own frames there, innermost first, "function (file:line)"
    since: float | None = None  # monotonic: this stack is known to have held since then (no thread ran between); None: ``time``
    read: bool = True  # read from the process (py-spy); False: carried from the last read (see ``probed``)
    probed: bool = False  # carried although threads ran: the stack probe read the same Python state as at that read

    @property
    def held_from(self) -> float:
        """Since when this stack is known to have held (its ``since``, else when it was taken)."""
        return self.since if self.since is not None and self.since < self.time else self.time


def locals_digest(threads: Sequence[dict[str, Any]], helper: Any = None) -> int | None:
    """A hash of the local variables (``py-spy --locals``) of every frame of the program's threads
    (``helper(thread)`` says which are the machinery's): a loop that computes changes some; a
    thread that waits changes none. None when the dump has no locals."""
    seen = False
    parts = []
    for t in threads:
        if helper is not None and helper(t) or is_reporter_thread(t):
            continue
        for f in t.get("frames") or []:
            values = f.get("locals") if isinstance(f, dict) else None
            if isinstance(values, list):
                seen = seen or bool(values)
                # The object's address too: py-spy prints a big int as "+bigint" and a torn read may
                # repeat an old repr, but a variable rebound to a new object has a new address.
                parts.append(tuple((str(v.get("name")), str(v.get("addr")), str(v.get("repr"))[:120])
                                   for v in values if isinstance(v, dict)))
    return hash(tuple(parts)) if seen else None


def signature_of(threads: Sequence[dict[str, Any]]) -> tuple[tuple[tuple[str, str, int], ...], ...]:
    """Each of the program's Python threads' frames (function, file, line), innermost first, in one order."""
    sig = []
    for t in threads:
        if is_reporter_thread(t):
            continue  # hangwatchd's reporter: it moves only when the daemon asks
        frames = tuple((str(f.get("name")), str(f.get("filename")), int(f.get("line") or 0)) for f in t.get("frames") or [])
        sig.append(frames)
    return tuple(sorted(sig))


@dataclass(frozen=True)
class StackHistory:
    """The samples of one process since its stack last changed (a value: ``added`` makes the next)."""

    samples: tuple[Sample, ...] = ()  # the run's first sample and its latest ones (KEEP at most)
    count: int = 0  # samples in the run, all of them

    def added(self, s: Sample) -> StackHistory:
        """The history with ``s`` in it: a sample that failed changes nothing, another stack starts over."""
        if s.error:
            return self
        if self.samples and self.samples[-1].signature != s.signature:
            return StackHistory((s,), 1)
        kept = self.samples if len(self.samples) < KEEP else (self.samples[0], *self.samples[2:])
        return StackHistory((*kept, s), self.count + 1)

    def frozen_for(self) -> float:
        """Seconds the same stack has held: from when its first sample knew it held (a sample taken
        after the process stopped running knows since when, ``Sample.since``) to the latest (0 with
        fewer than two samples)."""
        if len(self.samples) < 2:
            return 0.0
        return self.samples[-1].time - self.samples[0].held_from

    def frozen_from(self) -> float | None:
        """When the run's stack began to hold, as far as is known (None with no sample)."""
        return self.samples[0].held_from if self.samples else None

    def locals_moved(self) -> bool:
        """The program's local variables changed over the run although its stack did not: it computes."""
        digests = {s.locals_digest for s in self.samples if s.locals_digest is not None}
        return len(digests) > 1

    def evidence(self) -> str:
        first, last = self.samples[0], self.samples[-1]
        carried = any(not s.read and not s.probed for s in self.samples)
        probed = any(s.probed for s in self.samples)
        parts = [f"{self.count} samples with the same stack over {self.frozen_for():.0f} s"
                 + (" (no thread ran between some: read once, carried over those)" if carried else "")
                 + (" (the probe read the same frames and locals at some: py-spy's read carried over those)" if probed else "")]
        if first.cpu_seconds is not None and last.cpu_seconds is not None:
            parts.append(f"CPU +{last.cpu_seconds - first.cpu_seconds:.2f} s")
        if first.ctx_switches is not None and last.ctx_switches is not None:
            parts.append(f"context switches +{last.ctx_switches - first.ctx_switches}")
        return ", ".join(parts)
