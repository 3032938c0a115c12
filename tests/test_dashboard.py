"""The Grafana dashboard: every query parses (promtool) and names only metrics a real daemon exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from hangwatchd.testing import ScratchDaemon

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
# Grafana's variables, as a dashboard user's choice would fill them in.
VARIABLES = {"$__rate_interval": "1m", "$__range": "6h", "$Hostname": ".*", "$job": ".*"}
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
    for needed in ("hangwatchd_hangs_total", "hangwatchd_watched_processes", "time() - hangwatchd_last_beat_timestamp_seconds",
                   "hangwatchd_capture_step_duration_seconds_bucket", "hangwatchd_capture_step_failures_total",
                   "hangwatchd_last_incident_timestamp_seconds", "on (Hostname)"):
        assert needed in exprs, needed
    by_job_and_node = [e for t, e in _queries() if "job" in t.lower() and "node" in t.lower()]
    assert by_job_and_node and all("job" in e and "Hostname" in e for e in by_job_and_node)


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
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every metric name a real daemon's /metrics has, scraped over HTTP (TYPE lines too: a labelled
    metric with no series yet still declares itself)."""
    with ScratchDaemon(tmp_path_factory.mktemp("dash")) as d:
        text = d.scrape()
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
    families = {n for n in families if not (n + "_total") in families}
    assert documented == families
