"""Many nodes through a shared S3-compatible store: a real moto server, real daemons standing for nodes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangwatchd.testing import ScratchDaemon, stop, wait_for
from tests.s3server import S3Server

from .conftest import hangwatchd

# Rank 0 stops beating inside a function that stands for a collective; rank 1 keeps beating
# in another branch, never joining it.
RANKS = """
import sys, threading, time
import hangwatchd

def all_reduce():
    threading.Event().wait()

def other_branch():
    while True:
        hangwatchd.beat()
        time.sleep(0.1)

for _ in range(20):
    hangwatchd.beat()
    time.sleep(0.05)
print("diverging", flush=True)
if sys.argv[1] == "stuck":
    all_reduce()
else:
    other_branch()
"""

FAST = {"pyspy_native": False, "gpu_dump": "never", "store_poll_interval": 0.5, "capture_steps": ["proc", "progress", "pyspy"]}


def node(base: Path, name: str, s3: S3Server, **config: object) -> ScratchDaemon:
    return ScratchDaemon(base / name, "--store", s3.url(), "--node-name", name, env=s3.env, config={**FAST, **config})


def rank(d: ScratchDaemon, job: str, r: int, how: str, timeout: float) -> subprocess.Popen[bytes]:
    return d.run([sys.executable, "-c", RANKS, how], "--job", job, "--rank", str(r), "--heartbeat-timeout", str(timeout),
                 stdout=subprocess.PIPE, env=dict(os.environ, WORLD_SIZE="2"))



def analyze_store(s3: S3Server, job: str) -> dict | None:
    res = hangwatchd("analyze", "--store", s3.url(), "--job", job, "--json", env=s3.env)
    if res.returncode != 0:
        return None
    return json.loads(res.stdout)


def test_the_rank_that_left_the_lockstep_is_named_with_its_node(tmp_path: Path, s3: S3Server) -> None:
    job = "train-42"
    with node(tmp_path, "node-a", s3) as a, node(tmp_path, "node-b", s3) as b:
        r0 = rank(a, job, 0, "stuck", 2.0)
        r1 = rank(b, job, 1, "branch", 2.0)
        try:
            assert r0.stdout is not None and r0.stdout.readline() == b"diverging\n"
            deadline = time.monotonic() + 2.0 + 15.0  # rank 0's last beat, its timeout, then 15 s

            def both() -> dict | None:
                got = analyze_store(s3, job)
                return got if got and len([r for r in got["ranks"] if r["node"]]) == 2 else None

            result = wait_for(both, deadline - time.monotonic(), "both ranks in the store", every=0.5)
            assert {(r["rank"], r["node"]) for r in result["ranks"]} == {(0, "node-a"), (1, "node-b")}
            first = result["culprits"][0]
            assert (first["rank"], first["node"]) == (1, "node-b")
            assert first["location"].startswith("other_branch ")
            assert "rank 1 on node-b" in result["summary"].lower()
            assert result["nodes"] == ["node-a", "node-b"] and result["ranks_not_captured"] == []
            # Rank 1 was captured because node-a asked, under the same job incident.
            inc_b = json.loads((Path(b.store().list()[0]["dir"]) / "incident.json").read_text())
            inc_a = json.loads((Path(a.store().list()[0]["dir"]) / "incident.json").read_text())
            assert inc_b["reason"] == "job-request" and inc_b["node"] == "node-b"
            assert inc_a["job_incident"] == inc_b["job_incident"] == result["job_incident"]
            proc_b = json.loads(next(Path(b.store().list()[0]["dir"]).glob("*/proc.json")).read_text())
            assert proc_b["node"] == "node-b"
            assert a.metric("hangwatchd_hangs_total", node="node-a") == 1.0
        finally:
            stop(r0, r1)
        listed = hangwatchd("incidents", "--store", s3.url(), "--job", job, "--json", env=s3.env)
        assert listed.returncode == 0, listed.stderr
        items = json.loads(listed.stdout)
        assert len(items) == 1 and items[0]["nodes"] == ["node-a", "node-b"] and items[0]["ranks"] == [0, 1]
        table = hangwatchd("incidents", "--store", s3.url(), env=s3.env)
        assert job in table.stdout and "node-a,node-b" in table.stdout
        text = hangwatchd("analyze", "--store", s3.url(), "--job", job, env=s3.env).stdout
        assert "nodes node-a, node-b" in text and re.search(r"Culprit: rank 1 \(pid \d+ on node node-b\)", text), text


def test_one_job_hang_is_one_job_incident_however_many_nodes_notice(tmp_path: Path, s3: S3Server) -> None:
    job = "train-43"
    with node(tmp_path, "node-a", s3) as a, node(tmp_path, "node-b", s3) as b:
        r0 = rank(a, job, 0, "stuck", 2.0)
        r1 = rank(b, job, 1, "stuck", 2.5)
        try:
            wait_for(lambda: len(s3.keys("hw/jobs/")) >= 2, 30, "both nodes' parts in the store", every=0.5)
            time.sleep(3)  # room for a second, duplicate request or capture to show up
        finally:
            stop(r0, r1)
        items = json.loads(hangwatchd("incidents", "--store", s3.url(), "--json", env=s3.env).stdout)
        assert len(items) == 1, items
        assert sorted(items[0]["nodes"]) == ["node-a", "node-b"]
        assert len(a.store().list()) == 1 and len(b.store().list()) == 1
        shown = hangwatchd("show", b.store().list()[0]["id"], "--state-dir", str(b.state_dir)).stdout
        # Its own id, or the one it adopted when both nodes declared the hang at once (the store says which).
        assert "job incident job-" in shown and "(node node-b)" in shown
        manifests = s3.keys("hw/jobs/")
        assert len(manifests) == 2, manifests


def test_store_down_during_the_hang(tmp_path: Path) -> None:
    s3 = S3Server().start()
    try:
        port = s3.port
        d = node(tmp_path, "node-a", s3)
        p = rank(d, "train-44", 0, "stuck", 2.0)
        s3.stop()  # the store goes down before the hang
        try:
            incidents = wait_for(lambda: d.settled(), 30, "the local incident")
            assert incidents[0]["complete"]
            local = Path(incidents[0]["dir"])
            assert (local / "incident.json").is_file() and list(local.glob("*/pyspy.json"))
            spool = d.state_dir / "store-spool"
            wait_for(lambda: any("incident" in n for n in os.listdir(spool)), 10, "the upload spooled")
        finally:
            stop(p)
            d.stop()
        # The daemon restarts with the store still down, then the store comes back (empty: moto forgets).
        d = node(tmp_path, "node-a", s3)
        try:
            s3 = S3Server(port=port).start()
            wait_for(lambda: s3.keys("hw/jobs/"), 60, "the incident in the store", every=0.5)
            wait_for(lambda: not os.listdir(d.state_dir / "store-spool"), 10, "the spool emptied")
            assert d.metric_total("hangwatchd_store_sends_total", outcome="ok") >= 2  # the request, then the incident
            assert d.metric("hangwatchd_store_spooled") == 0
        finally:
            d.stop()
        d = node(tmp_path, "node-a", s3)  # and once more: nothing is sent twice
        d.stop()
        manifests = s3.keys("hw/jobs/")
        assert len(manifests) == 1 and manifests[0].endswith(f"/node-a/{incidents[0]['id']}.json")
        m = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=manifests[0])["Body"].read())
        parts = s3.keys(f"hw/nodes/node-a/incidents/{incidents[0]['id']}/")
        assert sorted(k.split(f"{incidents[0]['id']}/", 1)[1] for k in parts) == sorted(f["path"] for f in m["files"])
        assert "incident.json" in [f["path"] for f in m["files"]]
        res = hangwatchd("analyze", "--store", s3.url(), "--job", "train-44", "--json", env=s3.env)
        assert res.returncode == 0, res.stderr
        ranks = {r["rank"]: r for r in json.loads(res.stdout)["ranks"]}
        assert ranks[0]["node"] == "node-a" and (ranks[1]["node"], ranks[1]["verdict"]) == (None, "not-here")
        assert json.loads(res.stdout)["ranks_not_captured"] == [1]
    finally:
        s3.stop()


def test_bad_store_url_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = hangwatchd("daemon", "--state-dir", str(tmp_path / "s"), "--runtime-dir", str(tmp_path / "r"),
                     "--store", "http://bucket/prefix")
    assert res.returncode == 2
    assert "s3://BUCKET/PREFIX" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = hangwatchd("analyze", "--store", "s3://Bad_Bucket/x", "--job", "j")
    assert res.returncode == 2 and "not a valid bucket name" in res.stderr
    res = hangwatchd("analyze", "--store", "s3://bucket/x")
    assert res.returncode == 2 and "--job" in res.stderr


def test_unreachable_store_is_one_line_and_exit_1(tmp_path: Path) -> None:
    from tests.s3server import free_port

    env = {**S3Server().env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    res = hangwatchd("incidents", "--store", "s3://bucket/x", env=env)
    assert res.returncode == 1 and "s3://bucket/x" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_the_deploy_examples_show_the_store_settings() -> None:
    import tomllib
    import yaml

    from hangwatchd import config

    root = Path(__file__).parent.parent
    docs = {d["kind"]: d for d in yaml.safe_load_all((root / "deploy" / "kubernetes" / "pod.yaml").read_text())}
    cm = config.load(None, tomllib.loads(docs["ConfigMap"]["data"]["hangwatchd.toml"]))
    assert cm.store.startswith("s3://")
    (sidecar,) = [c for c in docs["Pod"]["spec"]["initContainers"] if c.get("restartPolicy") == "Always"]
    env = {e["name"]: e for e in sidecar["env"]}
    secret = docs["Secret"]["metadata"]["name"]
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret and ref["key"] in docs["Secret"]["stringData"]
    assert env["AWS_ENDPOINT_URL"]["value"].startswith("https://")
    unit = (root / "systemd" / "hangwatchd.service").read_text()
    assert "EnvironmentFile=-/etc/hangwatchd/store.env" in unit and "AWS_ENDPOINT_URL" in unit


def test_the_ranks_of_a_node_are_captured_side_by_side(tmp_path: Path) -> None:
    """Four ranks whose flight recorders never answer: their waits overlap instead of adding up."""
    fr_timeout = 2.0
    with ScratchDaemon(tmp_path, config={"pyspy_native": False, "gpu_dump": "never", "flight_recorder_timeout": fr_timeout}) as d:
        argv = [sys.executable, "-m", "hangwatchd.testing", "gpu-workload", "--cuda", "none", "--fr", "silent", "--beats", "20"]
        procs = [d.run(argv, "--job", "side", "--rank", str(r), "--heartbeat-timeout", "2",
                       env=dict(os.environ, RANK=str(r), WORLD_SIZE="4"), stdout=subprocess.DEVNULL) for r in range(4)]
        try:
            (inc,) = wait_for(d.settled, 60, "the incident")
            data = json.loads((Path(inc["dir"]) / "incident.json").read_text())
            assert sorted(p["rank"] for p in data["processes"]) == [0, 1, 2, 3]
            waits = [s["seconds"] for p in data["processes"] for s in p["steps"] if s["step"] == "flight_recorder"]
            assert len(waits) == 4 and all(w >= fr_timeout * 0.9 for w in waits)
            stored = d.event("incident_stored")
            assert stored["seconds"] < sum(waits) - fr_timeout  # one after another would take at least their sum
        finally:
            stop(*procs)


def test_the_lockstep_rule_on_a_directory_put_together_by_hand(tmp_path: Path) -> None:
    """A rank without beats whose stack moved counts as progress; the verdict names it with its node."""
    from hangwatchd.analyze.verdict import analyze

    def rank_dir(name: str, r: int, node_name: str, func: str, progress: dict) -> None:
        d = tmp_path / name
        d.mkdir()
        (d / "proc.json").write_text(json.dumps({"pid": 100 + r, "rank": r, "node": node_name, "world_size": 3}))
        frames = [{"name": func, "filename": "/srv/train.py", "short_filename": "train.py", "line": 10 + r}]
        (d / "pyspy.json").write_text(json.dumps([{"thread_name": "MainThread", "frames": frames}]))
        (d / "progress.json").write_text(json.dumps(progress))

    hung = {"beating": False, "beats": 0, "stack_moved": None, "progressing": False}
    rank_dir("n1-100", 0, "n1", "all_reduce", hung)
    rank_dir("n2-101", 1, "n2", "all_reduce", hung)
    rank_dir("n3-102", 2, "n3", "load_batch", {"beating": None, "beats": None, "stack_moved": True, "progressing": True})
    result = analyze(tmp_path).to_dict()
    assert [(c["rank"], c["node"], c["location"]) for c in result["culprits"]] == [(2, "n3", "load_batch (/srv/train.py:12)")]
    assert "stack moved" in result["culprits"][0]["reason"]
    assert result["summary"].startswith("Rank 2 on n3 is at load_batch")
    # Everyone hung alike: the rule stays silent and the others speak.
    (tmp_path / "n3-102" / "progress.json").write_text(json.dumps(hung))
    assert "left the lockstep" not in analyze(tmp_path).summary


@pytest.mark.parametrize("url", ["s3://b/p", "s3:/bucket/p", "S3://bucket", "s3://bucket/../x", "s3://bu\ncket/p", ""])
def test_store_urls_are_checked(url: str) -> None:
    from hangwatchd.fleet.url import StoreURLError, parse

    if url in ("s3://bucket/../x",):
        assert parse(url).prefix == "../x"  # a key prefix, not a path: S3 keys may hold dots
        return
    with pytest.raises(StoreURLError):
        parse(url)


def test_store_url_parser_never_fails_otherwise() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hangwatchd.fleet.url import StoreURLError, parse

    @settings(max_examples=300, deadline=None)
    @given(st.text(max_size=80))
    def one(text: str) -> None:
        try:
            u = parse("s3://" + text)
        except StoreURLError as exc:
            assert "s3://" in str(exc)
        else:
            assert str(u).startswith("s3://" + u.bucket) and not u.prefix.startswith("/")

    one()
