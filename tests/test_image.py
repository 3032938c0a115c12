"""The container image, built by ./dev image from the Dockerfile (no registry: the base comes from
Debian's archive), run as a user runs it: --version, check, the daemon's metrics, and the
Kubernetes sidecar shape (a shared process namespace) capturing a hang in the other container."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatchd.incidents.store import Store
from hangwatchd.testing import wait_for

from . import podman
from .conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
VERSION = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]  # the pattern matches, or the test fails right here


@pytest.fixture(scope="module")
def image() -> str:
    podman.require()
    return podman.image()


def test_the_image_pins_what_it_installs_from_the_constraints_file(image: str) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.count("nvidia-ml-py") == 0  # a dependency of the package, pinned there, listed once
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    python = ["--entrypoint", "/opt/hangwatchd/bin/python"]
    res = podman.run(image, "-m", "pip", "--version", options=python, check=False)
    assert res.returncode == 1 and "No module named pip" in res.stderr  # the installer is not shipped
    listed = json.loads(podman.run(image, "-c", "import importlib.metadata as m, json; "
                                   "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
                                   options=python).stdout)
    for name, version in listed.items():
        if name == "hangwatchd":
            assert version == VERSION
            continue
        key = next((k for k in pins if k.lower().replace("_", "-") == name.lower().replace("_", "-")), None)
        assert key is not None, f"{name} {version} is in the image but not in constraints.txt"
        assert pins[key] == version, f"{name}: image has {version}, constraints.txt pins {pins[key]}"
    assert {"py-spy", "nvidia-ml-py", "nvidia-cuda-nvdisasm"} <= set(listed)


def test_version_and_check_in_the_image(image: str) -> None:
    res = podman.run(image, "--version")
    assert res.stdout.strip() == f"hangwatchd {VERSION}"
    res = podman.run(image, "check", "--json", options=["--cap-add", "SYS_PTRACE"], check=False)
    checks = {c["name"]: c for c in json.loads(res.stdout)}
    assert res.returncode == 0, res.stdout + res.stderr
    assert checks["py-spy"]["ok"] and "read a test child's stack" in checks["py-spy"]["detail"]
    assert checks["nvdisasm"]["ok"] and "/opt/hangwatchd/" in checks["nvdisasm"]["detail"]
    assert checks["ptrace"]["ok"] and "CAP_SYS_PTRACE held" in checks["ptrace"]["detail"]


@pytest.fixture
def pod(image: str, tmp_path: Path) -> Iterator[tuple[podman.Container, Path]]:
    """The daemon as the image runs it by default, in a container whose process namespace and
    network a workload container joins (what Kubernetes' shareProcessNamespace gives a pod)."""
    run, state, dumps = tmp_path / "run", tmp_path / "state", tmp_path / "dumps"
    for d in (run, state, dumps):
        d.mkdir()
    config = tmp_path / "hangwatchd.toml"
    text = (ROOT / "config" / "hangwatchd.toml").read_text()
    config.write_text(re.sub(r'(?m)^gpu_dump = .*$', 'gpu_dump = "always"', text))
    daemon = podman.Container(image, options=[
        "--cap-add", "SYS_PTRACE", "--network", "none",
        "-v", f"{run}:/run/hangwatchd", "-v", f"{state}:/var/lib/hangwatchd", "-v", f"{dumps}:/var/lib/hangwatchd-dumps",
        "-v", f"{config}:/etc/hangwatchd/hangwatchd.toml:ro",
        "-e", "POD_NAME=train-llama", "-e", "POD_NAMESPACE=ml", "-e", "CONTAINER_NAME=trainer"])
    try:
        wait_for(lambda: "hangwatchd_watched_processes" in daemon.scrape(check=False), 60, "the daemon's metrics", every=0.5)
        yield daemon, tmp_path
    finally:
        daemon.remove()


def test_the_sidecar_captures_a_hang_in_the_other_container(pod: tuple[podman.Container, Path], image: str) -> None:
    daemon, base = pod
    state = base / "state"
    metrics = daemon.scrape()
    assert 'pod="train-llama"' in metrics and 'namespace="ml"' in metrics
    # hangwatchd check beside the running daemon: its port in use by that daemon is fine.
    res = daemon.exec("hangwatchd", "check", check=False)
    assert res.returncode == 0 and "in use by the running daemon" in res.stdout, res.stdout
    # The workload: another container, another user, the same pid namespace, network and the
    # runtime and dump dirs; it runs through hangwatchd run, as deploy/kubernetes/pod.yaml says.
    fixture = FIXTURES / "cpp_hang"
    with podman.Container(image, "run", "--heartbeat-timeout", "1", "--",
                          "python3", "-m", "hangwatchd.testing", "gpu-workload", "--dump", "/fixtures/coredump.nvcudmp.xz",
                          options=["--pid", f"container:{daemon.name}", "--network", f"container:{daemon.name}",
                                   "--user", "1000:1000", "-e", "HOME=/tmp",
                                   "-v", f"{base / 'run'}:/run/hangwatchd", "-v", f"{base / 'dumps'}:/var/lib/hangwatchd-dumps",
                                   "-v", f"{fixture}:/fixtures:ro"]) as work:
        # Stored once its stacks are in; complete once the GPU dump has been added too.
        (inc,) = wait_for(lambda: [i for i in Store(state).list() if not i["pending"]], 60, "a complete incident from the sidecar",
                          every=0.5)
        data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
        (proc,) = data["processes"]
        steps = {s["step"]: s for s in proc["steps"]}
        assert steps["pyspy"]["ok"] and steps["cuda_dump"]["ok"] and steps["flight_recorder"]["ok"], steps
        pdir = Path(inc["dir"]) / str(inc["processes"][0])
        assert json.loads((pdir / "symbolized.json").read_text())["kernels"][0]["name"] == "consumer_kernel(int volatile*, int*)"
        pyspy = json.dumps(json.loads((pdir / "pyspy.json").read_text()))
        assert "_gpu_workload" in pyspy and "hangwatchd/testing.py" in pyspy
        # The dump ended the workload (as a real one ends the process), so its container stops.
        wait_for(lambda: not work.inspect()["State"]["Running"], 30, "the workload's container to stop", every=0.5)
        assert work.inspect()["State"]["ExitCode"] == 134
    scraped = daemon.scrape()
    assert re.search(r'^hangwatchd_hangs_total\{[^}]*reason="heartbeat"[^}]*\} 1\.0$', scraped, re.M), scraped


def test_a_workload_image_without_hangwatchd_gets_the_launcher_from_the_sidecar_image(
        pod: tuple[podman.Container, Path], image: str) -> None:
    """deploy/kubernetes/pod.yaml's shape: an init container copies the image's hangwatchd-job.pyz into a
    shared volume; the workload runs in an image with python3 and no hangwatchd (the Debian base
    stands in for a stock PyTorch image), through `python3 .../hangwatchd-job.pyz run`, and its
    `import hangwatchd; hangwatchd.beat()` works with nothing installed."""
    daemon, base = pod
    job_dir = base / "job"
    job_dir.mkdir()
    podman.run(image, "/opt/hangwatchd/job/hangwatchd-job.pyz", "/hangwatchd-job/",
               options=["--entrypoint", "cp", "-v", f"{job_dir}:/hangwatchd-job"])
    assert (job_dir / "hangwatchd-job.pyz").is_file()
    stock = podman.base_image()
    bare = podman.run(stock, "-c", "import hangwatchd", options=["--entrypoint", "python3"], check=False)
    assert bare.returncode == 1 and "No module named 'hangwatchd'" in bare.stderr  # nothing of ours in it
    job = ("import threading, time\nimport hangwatchd\nfor _ in range(20):\n    hangwatchd.beat()\n    time.sleep(0.05)\n"
           "def wait_for_the_peer():\n    threading.Event().wait()\nwait_for_the_peer()\n")
    with podman.Container(stock, "/opt/hangwatchd-job/hangwatchd-job.pyz", "run", "--job", "stock", "--heartbeat-timeout", "1",
                          "--", "python3", "-c", job,
                          options=["--entrypoint", "python3", "--pid", f"container:{daemon.name}",
                                   "--network", f"container:{daemon.name}", "--user", "1000:1000", "-e", "HOME=/tmp",
                                   "-e", "HANGWATCHD_RUNTIME_DIR=/run/hangwatchd",
                                   "-v", f"{job_dir}:/opt/hangwatchd-job:ro", "-v", f"{base / 'run'}:/run/hangwatchd",
                                   "-v", f"{base / 'dumps'}:/var/lib/hangwatchd-dumps"]) as work:
        (inc,) = wait_for(lambda: [i for i in Store(base / "state").list() if i["job"] == "stock"], 60,
                          "the stock image's job incident", every=0.5)
        assert inc["reason"] == "heartbeat" and "wait_for_the_peer" in inc["summary"], (inc, work.logs())
