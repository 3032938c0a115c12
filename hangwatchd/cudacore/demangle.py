"""C++ names demangled by the C++ runtime's own ``__cxa_demangle``, loaded by its soname.

cxxfilt does the same, but finds the libraries with ``ctypes.util.find_library``,
which runs ``ldconfig -p`` in a subprocess: 30 ms of every `hangwatchd symbolize`,
more than reading a small dump. It stays the fallback where the soname is not there.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

SONAMES = ("libstdc++.so.6", "libc++.so.1", "libc++abi.so.1")

_demangler: Callable[[bytes], bytes | None] | None = None


def _load() -> Callable[[bytes], bytes | None]:
    for soname in SONAMES:
        try:
            lib = ctypes.CDLL(soname)
            libc = ctypes.CDLL(None)
            cxa = lib.__cxa_demangle
        except (OSError, AttributeError):
            continue
        cxa.restype = ctypes.c_void_p
        cxa.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        free = libc.free
        free.argtypes = [ctypes.c_void_p]

        def run(mangled: bytes, cxa: Any = cxa, free: Any = free) -> bytes | None:
            status = ctypes.c_int(-1)
            out = cxa(mangled, None, None, ctypes.byref(status))
            if not out:
                return None
            try:
                return ctypes.string_at(out) if status.value == 0 else None
            finally:
                free(out)
        return run
    return _cxxfilt


def _cxxfilt(mangled: bytes) -> bytes | None:
    try:
        import cxxfilt  # the daemon's dependency; the job side (driverlog) has no C++ runtime need for it
    except ImportError:
        return None
    try:
        return cxxfilt.demangleb(mangled)
    except (cxxfilt.InvalidName, cxxfilt.LibraryNotFound):
        return None


def demangle_symbol(mangled: str) -> str:
    """The C++ name of ``mangled``; the name as it is where it is not a valid mangled name."""
    global _demangler
    if _demangler is None:
        _demangler = _load()
    try:
        out = _demangler(mangled.encode())
        return out.decode() if out is not None else mangled
    except UnicodeError:
        return mangled
