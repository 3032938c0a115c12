from __future__ import annotations

import lzma
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .s3server import S3Server

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


def extract(archive: Path, dest: Path) -> None:
    """Extract a fixture archive safely, also on Python 3.11.2 (Debian 12), whose tarfile has no filter=."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
            return
        root = dest.resolve()
        for m in tar.getmembers():
            target = (dest / m.name).resolve()
            if not (m.isfile() or m.isdir()) or not target.is_relative_to(root):
                raise ValueError(f"{archive}: refusing member {m.name!r} (only plain files inside the archive)")
        tar.extractall(dest)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


# -- no process started by a test outlives it ----------------------------------
#
# Every process a test starts inherits HANGWATCHD_TEST_MARK (the test's own value);
# after the test, whatever still carries it is a leak: killed, and the test fails.
# A session-wide mark catches what escapes between tests.

MARK = "HANGWATCHD_TEST_MARK"
SESSION = "HANGWATCHD_TEST_SESSION"
GRACE_S = 5.0


def marked(var: str, value: str) -> list[int]:
    """Pids of live processes (not zombies, not us) whose environment holds var=value."""
    needle = f"{var}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read: not started by us either
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def reap_leaks(var: str, value: str) -> list[str]:
    """Wait a little for marked processes to end; kill the rest; describe what was left."""
    end = time.monotonic() + GRACE_S
    while (left := marked(var, value)) and time.monotonic() < end:
        time.sleep(0.1)
    described = []
    for pid in left:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        described.append(f"pid {pid}: {cmd[:160]}")
    return described


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION] = uuid.uuid4().hex


@pytest.fixture(autouse=True)
def no_process_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    value = uuid.uuid4().hex
    os.environ[MARK] = value
    yield
    os.environ.pop(MARK, None)
    leaks = reap_leaks(MARK, value)
    if leaks:
        pytest.fail(f"{request.node.nodeid} left {len(leaks)} processes running (killed now):\n  " + "\n  ".join(leaks))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # multiprocessing's helpers started in this process (the symboliser's fork server and
    # its resource tracker) are ours to stop, as a daemon stops them at exit.
    from multiprocessing import forkserver, resource_tracker

    forkserver._forkserver._stop()  # type: ignore[attr-defined]  # private: the one way to stop them before exit
    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]  # private, as above
    leaks = reap_leaks(SESSION, os.environ.get(SESSION, "-"))
    if leaks:
        sys.stderr.write(f"\nthe test run left {len(leaks)} processes running (killed now):\n  " + "\n  ".join(leaks) + "\n")
        session.exitstatus = 1


@pytest.fixture
def s3() -> Iterator[S3Server]:
    """A real S3 protocol server (moto) on loopback for the test, stopped by its pid after."""
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake_gpu() -> Iterator[Path]:
    """A file named like an NVIDIA device node: holding it open is what discovery looks for."""
    if not os.access("/dev", os.W_OK):
        pytest.skip("writes into /dev (a file named like an NVIDIA device node): needs root")
    path = Path(f"/dev/nvidia-hangwatchd-test-{uuid.uuid4().hex[:6]}")
    path.write_text("")
    yield path
    path.unlink()
