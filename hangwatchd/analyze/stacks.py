"""What a captured native stack says the process is waiting on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..detect import patterns
from .jsonfile import Unreadable, read_json

# Where library code lives; a frame elsewhere is the user's own code.
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ", "/hangwatchd/workload/client.py")


def is_user_frame(frame: dict[str, Any]) -> bool:
    filename = frame.get("filename") or ""
    if frame.get("module") or filename.endswith(".so") or ".so." in filename:
        return False  # native code
    if filename in ("", "?"):
        # py-spy's "0x4ce7c3 (?)": a native frame it could not name (a binary only the
        # process's own mount namespace holds, say). Unknown code is nobody's code.
        return False
    return not any(m in filename for m in _LIBRARY_MARKERS)


MAX_STACK_BYTES = 64 << 20


def read_threads(process_dir: Path) -> tuple[list[dict[str, Any]] | None, tuple[str, ...]]:
    """The threads py-spy saw (native stacks first), and a line for each stack file that could not be read.

    Never raises: the files come from a capture of a process someone else runs, or by hand.
    """
    problems = []
    for name in ("pyspy-native.json", "pyspy.json"):
        path = process_dir / name
        try:
            data = read_json(path, MAX_STACK_BYTES)
        except FileNotFoundError:
            continue
        except Unreadable as exc:
            why = f"not py-spy's JSON ({exc.detail})" if exc.kind == "not_json" else str(exc)
            problems.append(f"{path.parent.name}/{name}: {why}")
            continue
        if not isinstance(data, list):
            problems.append(f"{path.parent.name}/{name}: not a list of threads")
            continue
        threads = [_thread(t) for t in data if isinstance(t, dict)]
        if len(threads) < len(data):
            problems.append(f"{path.parent.name}/{name}: {len(data) - len(threads)} entries are not threads, skipped")
        return threads, tuple(problems)
    return None, tuple(problems)


def _thread(t: dict[str, Any]) -> dict[str, Any]:
    """A thread with only frames that are objects; names and files as strings, lines as ints."""
    raw = t.get("frames")
    frames = raw if isinstance(raw, list) else []
    clean = []
    for f in frames:
        if not isinstance(f, dict):
            continue
        f = dict(f)
        for key in ("name", "filename", "short_filename", "module"):
            if f.get(key) is not None and not isinstance(f[key], str):
                f[key] = str(f[key])
        if not isinstance(f.get("line"), int) or isinstance(f.get("line"), bool):
            f["line"] = 0
        clean.append(f)
    return {**t, "frames": clean, "thread_name": t.get("thread_name") if isinstance(t.get("thread_name"), str) else None}


def load_threads(process_dir: Path) -> list[dict[str, Any]] | None:
    return read_threads(process_dir)[0]


def gpu_wait(process_dir: Path) -> str | None:
    """The first native frame that waits on the GPU or in NCCL, if any thread shows one.

    Only what the native stack shows counts (a Python frame named like a collective
    may be gloo on the CPU): this gates the GPU dump, which ends the process.
    """
    frames = [f for t in load_threads(process_dir) or [] for f in t.get("frames") or [] if isinstance(f, dict)]
    named = patterns.first((str(f.get("name") or "") for f in frames), (patterns.COLLECTIVE_NATIVE, patterns.GPU_NATIVE))
    if named:  # a named wait says most
        return named
    for frame in library_frames(load_threads(process_dir) or []):
        return f"{frame.get('name')} ({frame.get('short_filename')})"
    return None


def library_frames(threads: list[dict[str, Any]], libraries: tuple[str, ...] = patterns.GPU_LIBRARIES) -> list[dict[str, Any]]:
    """Frames inside the CUDA driver or NCCL, of threads that run Python code.

    NCCL's proxy threads and PyTorch's watchdog live in those libraries all the
    time, busy or hung; a thread of the program's own that called down into
    them is what waits.
    """
    out = []
    for t in threads:
        frames = [f for f in t.get("frames") or [] if isinstance(f, dict)]
        if any(_is_python(f) for f in frames):
            out += [f for f in frames if str(f.get("short_filename") or "").startswith(libraries)]
    return out


def _is_python(frame: dict[str, Any]) -> bool:
    return not frame.get("module") and str(frame.get("filename") or "").endswith(".py")
