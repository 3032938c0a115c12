"""Containers for the image and systemd tests: rootful podman with runc, each container named by
the test and removed by that name when it ends (nothing left running, nothing left mounted)."""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("podman", "runc", "mmdebstrap")


def skip_reason() -> str | None:
    """Why this machine cannot run the image tests at all, or None. Only two reasons count:
    not root (rootful podman, mmdebstrap), and a kernel that refuses namespaces."""
    if os.geteuid() != 0:
        return "needs root: the image is built with mmdebstrap and run with rootful podman"
    res = subprocess.run(["unshare", "--user", "--mount", "--pid", "--fork", "true"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        return f"the kernel refuses user, mount or pid namespaces: {res.stderr.strip()}"
    return None


def require() -> None:
    """Skip (with the reason) where containers cannot run; fail where only the tools are missing."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: ./dev test installs them as root "
                    f"(apt-get install podman runc mmdebstrap)")


def flags() -> list[str]:
    """runc (crun refuses hybrid cgroup hosts) and ulimits no higher than the host's hard ones
    (podman's defaults are higher, and runc cannot raise a limit the host forbids)."""
    out = []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    if nofile != resource.RLIM_INFINITY:
        out.append(f"--ulimit=nofile={nofile}:{nofile}")
    if nproc != resource.RLIM_INFINITY:
        nproc = min(nproc, 32768)
        out.append(f"--ulimit=nproc={nproc}:{nproc}")
    return out


def podman(*args: str, timeout: float = 120, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True, timeout=timeout, input=input)
    if check and res.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} ... exited {res.returncode}: {res.stderr.strip()[-2000:]}")
    return res


def run(image: str, *args: str, options: Sequence[str] = (), check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman run --rm`` with no network (loopback only: the tests need nothing more)."""
    return podman("run", "--rm", "--network", "none", *flags(), *options, image, *args, check=check)


@functools.cache
def image() -> str:
    """The image ./dev image builds (the base made once, then podman's layer cache)."""
    res = subprocess.run(["bash", str(ROOT / "dev"), "image", "build"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


@functools.cache
def base_image() -> str:
    """The Debian base ./dev image builds the image on (python3, no hangwatchd): a stock image's stand-in."""
    image()
    res = subprocess.run(["bash", str(ROOT / "dev"), "image", "base"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


class Container:
    """One detached container; ``remove()`` (or the with-block's end) takes it away by its name."""

    def __init__(self, image: str, *args: str, options: Sequence[str] = ()) -> None:
        self.name = f"hangwatchd-test-{uuid.uuid4().hex[:12]}"
        podman("run", "--detach", "--name", self.name, *flags(), *options, image, *args)

    def exec(self, *argv: str, timeout: float = 60, check: bool = True, user: str | None = None,
             detach: bool = False) -> subprocess.CompletedProcess[str]:
        opts = (["--user", user] if user else []) + (["--detach"] if detach else [])
        return podman("exec", *opts, self.name, *argv, timeout=timeout, check=check)

    def python(self, code: str, timeout: float = 60, check: bool = True) -> str:
        return self.exec("/opt/hangwatchd/bin/python", "-c", code, timeout=timeout, check=check).stdout

    def scrape(self, port: int = 9842, check: bool = True) -> str:
        """/metrics over HTTP from inside the container ("" with check=False while nothing listens)."""
        return self.python(f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', "
                           f"timeout=5).read().decode())", check=check)

    def inspect(self) -> dict[str, Any]:
        return json.loads(podman("inspect", self.name).stdout)[0]

    def logs(self) -> str:
        res = podman("logs", self.name, check=False)
        return res.stdout + res.stderr

    def remove(self) -> None:
        podman("rm", "--force", "--depend", "--time", "0", self.name, check=False, timeout=60)
        left = podman("ps", "--all", "--filter", f"name={self.name}", "--format", "{{.Names}}", check=False)
        assert self.name not in left.stdout, f"container {self.name} outlived its test"

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *_: object) -> None:
        self.remove()
