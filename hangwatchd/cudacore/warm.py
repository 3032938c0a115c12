"""What a symbolising child needs, imported once in the fork server so that no child pays for it.

The command line imports these lazily (a small dump must start fast); the
daemon's fork server imports them all up front (every child is forked warm).
"""

import bz2  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)
import glob  # noqa: F401 - nvdisasm's lookups; the child cannot import after it drops root
import gzip  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)
import importlib.util  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)
import lzma  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)
import tempfile  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)

import cxxfilt  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)
import zstandard  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)

from ..host import subproc  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)
from . import cubin, demangle, elf, linetable, nvdisasm, reader, source, symbolize  # noqa: F401 - loaded before the symboliser forks (warm.py is nothing but this)

demangle.demangle_symbol("_Z1fv")  # the C++ runtime loaded once, here, for every child
