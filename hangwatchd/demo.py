"""The README's first command (interim): symbolise a bundled real GPU coredump."""

from __future__ import annotations

import sys
from pathlib import Path

from .cli import main

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gpu" / "cpp_ima" / "coredump.nvcudmp.xz"

if __name__ == "__main__":
    sys.exit(main(["symbolize", str(FIXTURE)]))
