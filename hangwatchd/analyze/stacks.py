"""What a captured native stack says the process is waiting on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..detect import patterns
from ..workload.introspect.reporter import is_reporter_thread
from .jsonfile import Unreadable, read_json

MAX_STACK_BYTES = 64 << 20


def read_threads(process_dir: Path) -> tuple[list[dict[str, Any]] | None, tuple[str, ...]]:
    """The threads py-spy saw (native stacks first), and a line for each stack file that could not be read.

    Never raises: the files come from a capture of a process someone else runs, or by hand.
    """
    problems: list[str] = []
    found = _read_one(process_dir, "pyspy-native.json", problems)
    if found is None:
        return _read_one(process_dir, "pyspy.json", problems), tuple(problems)
    plain = _read_one(process_dir, "pyspy.json", [])
    if plain:
        _attach_locals(found, plain)
    return found, tuple(problems)


def _attach_locals(native: list[dict[str, Any]], plain: list[dict[str, Any]]) -> None:
    """The plain dump's local variables (``py-spy --locals``) put on the native dump's Python frames,
    thread by thread and frame by frame where both name the same function at the same line."""
    by_tid = {t.get("os_thread_id"): t for t in plain if t.get("os_thread_id") is not None}
    for t in native:
        other = by_tid.get(t.get("os_thread_id"))
        if other is None:
            continue
        theirs = [f for f in other["frames"] if f.get("locals")]
        for f in t["frames"]:
            for i, g in enumerate(theirs):
                if g.get("name") == f.get("name") and g.get("line") == f.get("line") and g.get("filename") == f.get("filename"):
                    f["locals"] = g["locals"]
                    del theirs[: i + 1]
                    break


def _read_one(process_dir: Path, name: str, problems: list[str]) -> list[dict[str, Any]] | None:
    """One stack file's threads; None (and a line in ``problems`` unless it is absent) when it has none."""
    path = process_dir / name
    try:
        data = read_json(path, MAX_STACK_BYTES)
    except FileNotFoundError:
        return None
    except Unreadable as exc:
        why = f"not py-spy's JSON ({exc.detail})" if exc.kind == "not_json" else str(exc)
        problems.append(f"{path.parent.name}/{name}: {why}")
        return None
    if not isinstance(data, list):
        problems.append(f"{path.parent.name}/{name}: not a list of threads")
        return None
    threads = [_thread(t) for t in data if isinstance(t, dict)]
    if len(threads) < len(data):
        problems.append(f"{path.parent.name}/{name}: {len(data) - len(threads)} entries are not threads, skipped")
    return [t for t in threads if not is_reporter_thread(t)]


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
        if "locals" in f:
            f["locals"] = _locals(f["locals"])
        clean.append(f)
    ids = {k: v if isinstance(v, int) and not isinstance(v, bool) else None
           for k, v in ((k, t.get(k)) for k in ("thread_id", "os_thread_id"))}
    flags: dict[str, bool] = {k: t.get(k) is True for k in ("owns_gil", "active", "idle") if k in t}
    return {**t, **ids, **flags, "frames": clean,
            "thread_name": t.get("thread_name") if isinstance(t.get("thread_name"), str) else None}


MAX_LOCALS = 64


def _locals(value: Any) -> list[dict[str, Any]]:
    """py-spy's local variables of a frame: name, address, whether an argument, repr (each cut)."""
    out = []
    for v in value[:MAX_LOCALS] if isinstance(value, list) else []:
        if isinstance(v, dict) and isinstance(v.get("name"), str):
            addr = v.get("addr")
            out.append({"name": v["name"][:100], "addr": addr if isinstance(addr, int) and not isinstance(addr, bool) else None,
                        "arg": v.get("arg") is True, "repr": v["repr"][:300] if isinstance(v.get("repr"), str) else None})
    return out


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
