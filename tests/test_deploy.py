"""The shipped files an operator installs: checked by the tools operators use."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import tomllib
import yaml

from hangwatchd import config

ROOT = Path(__file__).resolve().parent.parent


def test_the_example_config_loads_and_holds_every_key_with_its_default() -> None:
    path = ROOT / "config" / "hangwatchd.toml"
    raw = tomllib.loads(path.read_text())
    assert set(raw) == set(config.KEYS)
    for key, value in raw.items():
        default = config.KEYS[key].default  # written as a person would: "50GiB" for 53687091200
        assert config.KEYS[key].parse(value) == config.KEYS[key].parse(default), key
    assert config.load(path) == config.Config()
    text = path.read_text().splitlines()
    for i, line in enumerate(text):  # a one-line comment above every key
        if "=" in line and not line.startswith("#"):
            assert text[i - 1].startswith("#"), line


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    unit = (ROOT / "systemd" / "hangwatchd.service").read_text()
    exe = shutil.which("hangwatchd") or str(Path(__import__("sys").executable).parent / "hangwatchd")
    (tmp_path / "hangwatchd.service").write_text(unit.replace("/opt/hangwatchd/bin/hangwatchd", exe))
    res = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "hangwatchd.service")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "" and res.stderr.strip() == "", res.stdout + res.stderr
    for needed in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "StateDirectory=hangwatchd",
                   "RuntimeDirectory=hangwatchd", "CAP_SYS_PTRACE", "SystemCallFilter=@system-service ptrace",
                   "ProtectSystem=strict", "ReadWritePaths=/var/lib/hangwatchd /run/hangwatchd /var/lib/hangwatchd-dumps"):
        assert needed in unit, needed
    assert "PrivateTmp=yes" not in unit


def test_promtool_checks_and_tests_the_alert_rules() -> None:
    cfg = ROOT / "config"
    check = subprocess.run(["promtool", "check", "rules", "alerts.yaml"], cwd=cfg, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run(["promtool", "test", "rules", "alerts.test.yaml"], cwd=cfg, capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    rules = yaml.safe_load((cfg / "alerts.yaml").read_text())["groups"][0]["rules"]
    exprs = " ".join(r["expr"] for r in rules)
    for metric in ("hangwatchd_hangs_total", "hangwatchd_gpu_exceptions_total", "hangwatchd_last_beat_timestamp_seconds",
                   "up{job=\"hangwatchd\"}", "hangwatchd_capture_step_failures_total"):
        assert metric in exprs, metric
    assert all("for" in r and r["annotations"]["summary"] for r in rules)


def test_the_kubernetes_example_holds_every_piece() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "pod.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Pod", "PersistentVolumeClaim", "ConfigMap", "Service", "Secret"}
    pod = kinds["Pod"]
    assert pod["apiVersion"] == "v1" and pod["spec"]["shareProcessNamespace"] is True
    copier, sidecar = pod["spec"]["initContainers"]  # in this order: the launcher is handed over first
    assert sidecar["restartPolicy"] == "Always" and "restartPolicy" not in copier
    assert "SYS_PTRACE" in sidecar["securityContext"]["capabilities"]["add"]
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert "emptyDir" in volumes["hangwatchd-run"] and "persistentVolumeClaim" in volumes["hangwatchd-state"]
    (trainer,) = pod["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    side_mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert mounts["hangwatchd-run"] == side_mounts["hangwatchd-run"] == config.DEFAULT_RUNTIME_DIR
    # The workload writes dumps where the daemon reads them, and never reaches the incidents.
    assert mounts["hangwatchd-dumps"] == side_mounts["hangwatchd-dumps"] == str(config.Config().dumps)
    assert "hangwatchd-state" not in mounts
    # A stock PyTorch image: the job side comes from the hangwatchd image, copied into a shared volume.
    assert trainer["image"].startswith("nvcr.io/nvidia/pytorch:") and copier["image"] == sidecar["image"]
    _hands_over_the_bundle(copier, trainer, volumes)
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert kinds["Service"]["spec"]["ports"][0]["port"] == 9842
    cm = tomllib.loads(kinds["ConfigMap"]["data"]["hangwatchd.toml"])
    config.load(None, cm)  # every key in it is one the daemon knows, with an allowed value


def _hands_over_the_bundle(copier: dict[str, Any], workload: dict[str, Any], volumes: dict[str, Any]) -> None:
    """The init container copies the image's hangwatchd-job.pyz into a volume the workload mounts,
    and the workload's command runs `hangwatchd run` from it with the image's own python3."""
    from hangwatchd.workload import bundle

    src, dest = copier["command"][1:]
    assert copier["command"][0] == "cp" and src == f"/opt/hangwatchd/job/{bundle.NAME}"
    ((vol, at),) = [(m["name"], m["mountPath"]) for m in copier["volumeMounts"]]
    assert dest.rstrip("/") == at and vol in volumes
    (mounted,) = [m for m in workload["volumeMounts"] if m["name"] == vol]
    assert mounted["readOnly"] is True
    assert workload["command"][:3] == ["python3", f"{mounted['mountPath']}/{bundle.NAME}", "run"]


def test_the_image_holds_the_bundle_the_init_containers_copy() -> None:
    from hangwatchd.workload import bundle

    text = (ROOT / "Dockerfile").read_text()
    assert "python -m hangwatchd.workload.bundle /opt/hangwatchd/job" in text and bundle.NAME == "hangwatchd-job.pyz"


def test_the_daemonset_example_watches_a_whole_node() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "daemonset.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"DaemonSet", "ConfigMap"}
    ds = kinds["DaemonSet"]
    assert ds["apiVersion"] == "apps/v1"
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"] == ds["spec"]["template"]["metadata"]["labels"]
    assert spec["hostPID"] is True
    (daemon,) = spec["containers"]
    assert "SYS_PTRACE" in daemon["securityContext"]["capabilities"]["add"] and daemon["securityContext"]["runAsUser"] == 0
    env = {e["name"]: e for e in daemon["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    # The node's own dirs, at the daemon's defaults, where the workloads of the node mount them too.
    for name, path in (("hangwatchd-run", config.DEFAULT_RUNTIME_DIR), ("hangwatchd-state", config.Config().state_dir),
                       ("hangwatchd-dumps", str(config.Config().dumps))):
        assert mounts[name] == volumes[name]["hostPath"]["path"] == path, name
    (copier,) = spec["initContainers"]
    # The commented workload in the file's head mounts the bundle the init container leaves on the node.
    head = yaml.safe_load("\n".join(line[4:] for line in (ROOT / "deploy" / "kubernetes" / "daemonset.yaml").read_text()
                                     .splitlines() if line.startswith("#   ")))
    (workload,) = head["containers"]
    assert head["hostPID"] is True
    workload_volumes = {v["name"]: v for v in head["volumes"]}
    assert workload_volumes["hangwatchd-job"]["hostPath"]["path"] == volumes["hangwatchd-job"]["hostPath"]["path"]
    _hands_over_the_bundle(copier, workload, {**volumes, **workload_volumes})
    for name in ("hangwatchd-run", "hangwatchd-dumps"):
        assert workload_volumes[name]["hostPath"]["path"] == volumes[name]["hostPath"]["path"]
    cm = config.load(None, tomllib.loads(kinds["ConfigMap"]["data"]["hangwatchd.toml"]))
    assert cm.discover is True
    assert spec["volumes"][-1]["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]


def test_the_dockerfile_installs_the_package_with_its_tools() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # The package with its extra, every version from the one constraints file (built and run for
    # real in tests/test_image.py).
    assert 'PIP_CONSTRAINT=/src/constraints.txt /opt/hangwatchd/bin/pip install --no-compile "/src[daemon,nvdisasm]"' in text
    assert 'ENTRYPOINT ["hangwatchd"]' in text and "EXPOSE 9842" in text
    for path in ("pyproject.toml", "hangwatchd", "config/hangwatchd.toml", "constraints.txt"):
        assert (ROOT / path).exists(), path
