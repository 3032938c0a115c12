from __future__ import annotations

import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
DUMPS = ["cpp_hang", "cpp_ima", "torch_ima", "triton_hang"]


@pytest.fixture(scope="session")
def raw_dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixture dumps decompressed once, for tests that damage or time them."""
    out = tmp_path_factory.mktemp("raw")
    paths = {}
    for name in DUMPS:
        p = out / f"{name}.nvcudmp"
        p.write_bytes(lzma.decompress((FIXTURES / name / "coredump.nvcudmp.xz").read_bytes()))
        paths[name] = p
    return paths


def hangwatchd(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real command line, as a user would."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "hangwatchd", *args],
        capture_output=True, text=True, timeout=timeout, env=full_env,
    )
