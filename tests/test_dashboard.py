"""The Grafana dashboard: every query parses (promtool) and names only metrics a real daemon exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
# Grafana's variables, as a dashboard user's choice would fill them in.
VARIABLES = {"$__rate_interval": "1m", "$__range": "6h", "$Hostname": ".*", "$workload_job": ".*"}
# The one family from elsewhere: dcgm-exporter's, joined on Hostname.
FOREIGN = re.compile(r"DCGM_FI_[A-Z_]+")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "le", "inf"}


def _queries() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    out = [(a["name"], a["expr"]) for a in d["annotations"]["list"]]
    panels = d["panels"] + [p for row in d["panels"] for p in row.get("panels", [])]
    out += [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
    return out


def _filled(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def _metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are not functions, keywords or label names."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        name, after = m.group(0), expr[m.end():].lstrip()[:1]
        if after == "(" or name.lower() in KEYWORDS:
            continue
        names.add(name)
    return names


def test_the_dashboard_covers_what_an_operator_asks() -> None:
    exprs = " ".join(e for _, e in _queries())
    for needed in ("hangwatchd_hangs_total", "hangwatchd_watched_processes", "time() - (hangwatchd_last_beat_timestamp_seconds",
                   "hangwatchd_capture_step_duration_seconds_bucket", "hangwatchd_capture_step_failures_total",
                   "hangwatchd_last_incident_timestamp_seconds", "on (Hostname)"):
        assert needed in exprs, needed
    by_job_and_node = [e for t, e in _queries() if "job" in t.lower() and "node" in t.lower()]
    assert by_job_and_node and all("workload_job" in e and "Hostname" in e for e in by_job_and_node)


def test_every_query_parses(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": _filled(expr)} for i, (_, expr) in enumerate(_queries())]}]}
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    res = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_queries())} rules found" in res.stdout


def test_a_broken_query_would_be_caught(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "r", "expr": "sum by (x (y)"}]}]}))
    assert subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, timeout=60).returncode != 0


@pytest.fixture(scope="module")
def exported_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real daemon's /metrics, scraped over HTTP while it watches a job that beats."""
    with ScratchDaemon(tmp_path_factory.mktemp("dash")) as d:
        work = d.run(workload_argv(beats=100_000, interval=0.1), "--job", "train", "--heartbeat-timeout", "5")
        try:
            def with_the_job() -> str | None:
                text = d.scrape()
                return text if 'workload_job="train"' in text else None
            return wait_for(with_the_job, 20, "the job's series")
        finally:
            stop(work)


@pytest.fixture(scope="module")
def exported(exported_text: str) -> set[str]:
    """Every metric name a real daemon's /metrics has (TYPE lines too: a labelled metric with no
    series yet still declares itself)."""
    text = exported_text
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            if kind == "counter":
                names |= {name if name.endswith("_total") else f"{name}_total"}
            if kind == "info":
                names.add(f"{name}_info")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_query_names_only_metrics_the_daemon_exports(exported: set[str]) -> None:
    assert "hangwatchd_last_incident_timestamp_seconds" in exported and "hangwatchd_build_info" in exported
    for title, expr in _queries():
        for name in _metric_names(_filled(expr)):
            assert name in exported or FOREIGN.fullmatch(name), f"{title!r}: {name} is not exported by the daemon"
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    for v in variables:
        if v["type"] == "query":
            (metric,) = re.findall(r"label_values\((\w+),", v["definition"])
            assert metric in exported


def test_the_parser_of_names_is_not_fooled() -> None:
    assert _metric_names('sum by (le, step) (rate(a_b_bucket{x="y"}[5m])) / on (Hostname) group_left () c > bool 0') == {"a_b_bucket", "c"}


def test_the_metrics_table_is_what_the_daemon_exports(exported: set[str]) -> None:
    doc = (ROOT / "docs" / "watching.md").read_text()  # the README links it
    table = doc[doc.index("### Metrics"):]
    table = table[:table.index("\n#", 1)] if "\n#" in table[1:] else table
    documented = set(re.findall(r"^\| `(hangwatchd_\w+)` \|", table, re.M))
    families = {n for n in exported if n.startswith("hangwatchd_")
                and not re.search(r"_(bucket|sum|count|created)$", n)}
    # a counter's family also shows without _total in TYPE-derived names: compare by the documented spelling
    families = {n for n in families if (n + "_total") not in families}
    assert documented == families


def test_the_dashboard_shows_the_workloads_job_names_in_a_real_prometheus(tmp_path: Path) -> None:
    """The dashboard's variables and panels, run by a real Prometheus that scrapes a real daemon with
    the scrape config docs/operating.md shows: the job they name is the workload's (hangwatchd run
    --job), never the scrape's own "hangwatchd" (a label named job would be renamed exported_job)."""
    from .test_alerts_live import PROMETHEUS, Prometheus

    if PROMETHEUS is None:
        pytest.skip("the prometheus server is not installed (./dev test installs Debian's)")
    fast = {"stack_interval": 0.5, "pyspy_native": False, "gpu_dump": "never", "capture_steps": ["proc", "pyspy"]}
    d = ScratchDaemon(tmp_path / "d", env={"NODE_NAME": "node-dash"}, config=fast)
    prom = Prometheus(tmp_path / "prom", [d.info["metrics_address"]])
    work = [d.run(workload_argv(beats=100_000, interval=0.1), "--job", "train-42", "--heartbeat-timeout", "2"),
            d.run(workload_argv(beats=5, interval=0.05), "--job", "hung-7", "--heartbeat-timeout", "1")]
    jobs = {"train-42", "hung-7"}
    try:
        wait_for(d.settled, 30, "the hung job's incident")
        wait_for(lambda: prom.query("hangwatchd_last_incident_timestamp_seconds"), 30, "the incident scraped")

        variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
        for name, want in (("Hostname", {"node-dash"}), ("workload_job", jobs)):
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variables[name]["definition"]).groups()  # type: ignore[union-attr]  # the pattern matches, or the test fails right here
            assert set(prom.api(f"label/{label}/values", **{"match[]": metric})) == want, name

        every = {"$__rate_interval": "1m", "$__range": "1h", "$Hostname": ".*", "$workload_job": ".*"}
        named: dict[str, set[str]] = {}
        for title, expr in _queries():
            for var, value in every.items():
                expr = expr.replace(var, value)
            result = prom.query(expr)  # a query Prometheus refuses raises here
            if "workload_job" in expr:
                named[title] = {r["metric"].get("workload_job") for r in result}
        assert named["Incidents by job and node"] == {"hung-7"}
        assert named["Latest incidents"] == {"hung-7"}
        assert named["Beat age per rank"] == named["Beat age / timeout"] == jobs
        # One job picked in the variable: only its series.
        one = {**every, "$workload_job": "train-42"}
        (beat_age,) = [e for t, e in _queries() if t == "Beat age per rank" and "time()" in e]
        for var, value in one.items():
            beat_age = beat_age.replace(var, value)
        assert {r["metric"]["workload_job"] for r in prom.query(beat_age)} == {"train-42"}

        # Prometheus's own job label is the scrape's, and nothing was renamed exported_job.
        assert {r["metric"]["job"] for r in prom.query('count by (job) ({__name__=~"hangwatchd_.+"})')} == {"hangwatchd"}
        assert prom.query('{__name__=~"hangwatchd_.+", exported_job!=""}') == []
        # The alert names the workload's job too: the hung one's beats are stale (pending for 5 minutes).
        stale = wait_for(lambda: [a for a in prom.active() if a["labels"]["alertname"] == "GPUHeartbeatStale"], 30, "GPUHeartbeatStale")
        assert [a["labels"]["workload_job"] for a in stale] == ["hung-7"]
        assert stale[0]["annotations"]["summary"].startswith("No heartbeat from job hung-7 rank ")
    finally:
        for w in work:
            stop(w)
        prom.stop()
        d.stop()


def test_no_metric_has_a_label_prometheus_keeps_for_itself(exported_text: str) -> None:
    labels = set(re.findall(r'[{,]([A-Za-z_][A-Za-z0-9_]*)="', exported_text))
    assert "workload_job" in labels and not labels & {"job", "instance"}, labels
