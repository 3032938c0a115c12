"""What an operator reads: tables that say when they cut, long kernel names once, a page per incident,
and the incident id in the metrics an alert links from."""

from __future__ import annotations

import json
import lzma
import re
import signal
import socket
from pathlib import Path

import pytest

from hangwatchd.testing import ScratchDaemon, stop, wait_for, workload_argv

from .conftest import FIXTURES, hangwatchd

LONG_ARG = "epoch-" + "x" * 70 + "-30"



def test_a_hang_gets_a_page_an_id_in_the_metrics_and_honest_columns(tmp_path: Path) -> None:
    with ScratchDaemon(tmp_path, config={"pyspy_native": False, "gpu_dump": "never"}) as d:
        work = d.run([*workload_argv(beats=10, interval=0.05), "--job", LONG_ARG], "--heartbeat-timeout", "2",
                     "--job", "train-" + "j" * 40)
        try:
            (inc,) = wait_for(d.settled, 30, "an incident")
            table = hangwatchd("status", "--runtime-dir", str(d.runtime_dir)).stdout
            row = next(ln for ln in table.splitlines() if ln.startswith(str(inc["processes"][0])))
            assert row.endswith("…") and LONG_ARG not in row  # cut, and saying so
            assert "train-jjjjj" in row and "…" in row.split()[1]  # the job column too
            status = json.loads(hangwatchd("status", "--json", "--runtime-dir", str(d.runtime_dir)).stdout)
            assert LONG_ARG in status["processes"][0]["cmdline"]  # JSON keeps the whole value
            job = "train-" + "j" * 40
            mine = json.loads(hangwatchd("incidents", "--json", "--job", job, "--state-dir", str(d.state_dir)).stdout)
            assert [i["id"] for i in mine] == [inc["id"]]  # --job filters this node's incidents too
            other = hangwatchd("incidents", "--job", "another-job", "--state-dir", str(d.state_dir))
            assert other.returncode == 0 and other.stdout.strip().endswith("for job another-job")

            page = Path(inc["dir"]) / "report.html"
            assert page.is_file() and (Path(inc["dir"]) / "incident.json").is_file()
            text = page.read_text()
            assert f"Incident {inc['id']}" in text and "<script" not in text and "http" not in text.split("</style>")[1]

            # The alert's link: the incident id as a label of the latest-incident series.
            d.event("incident_stored")  # the loop counts an incident once its worker is done
            scraped = d.scrape()
            (series,) = [ln for ln in scraped.splitlines() if ln.startswith("hangwatchd_last_incident_timestamp_seconds{")]
            assert f'incident="{inc["id"]}"' in series and 'reason="heartbeat"' in series
            assert 'workload_job="train-' in series and 'Hostname="' in series
            assert abs(float(series.rsplit(" ", 1)[1]) - inc["time"]) < 60
            stored = [e for e in d.logs() if e.get("event") == "incident_stored"]
            assert [e["incident"] for e in stored] == [inc["id"]]
        finally:
            stop(work, sig=signal.SIGKILL)


def test_a_templated_kernel_name_is_shortened_in_text_and_whole_in_json(tmp_path: Path) -> None:
    dump = FIXTURES / "torch_ima" / "coredump.nvcudmp.xz"
    sym = json.loads(hangwatchd("symbolize", "--json", str(dump)).stdout)
    name = sym["kernels"][0]["name"]
    assert len(name) > 900 and sym["exceptions"][0]["kernel"] == name

    text = hangwatchd("symbolize", str(dump)).stdout
    assert text.count(name) == 1  # once in full, at the end
    assert "Kernel void at::native::index_elementwise_kernel<…>(…)" in text
    assert max(len(ln) for ln in text.splitlines() if name not in ln) < 200

    with ScratchDaemon(tmp_path) as d:
        raw = lzma.decompress(dump.read_bytes())
        (d.dump_dir / f"core_{socket.gethostname()}.4343.1.nvcudmp").write_bytes(raw)
        (inc,) = wait_for(d.settled, 60, "the exception incident")
        assert name in inc["summary"]  # the index keeps it whole
        listing = hangwatchd("incidents", "--state-dir", str(d.state_dir)).stdout
        row = next(ln for ln in listing.splitlines() if ln.startswith(inc["id"]))
        assert "index_elementwise_kernel<…>(…)" in row and len(row) < 250
        shown = hangwatchd("show", inc["id"], "--state-dir", str(d.state_dir)).stdout
        assert shown.count(name) <= 1 and "index_elementwise_kernel<…>" in shown
        assert "--json has them whole" in shown
        whole = json.loads(hangwatchd("show", "--json", inc["id"], "--state-dir", str(d.state_dir)).stdout)
        assert name in whole["detail"]
        assert (Path(inc["dir"]) / "report.html").is_file()  # exception incidents get their page too
        assert re.search(rf'hangwatchd_last_incident_timestamp_seconds{{[^}}]*incident="{inc["id"]}"[^}}]*reason="gpu-exception"',
                         d.scrape())


def test_a_page_that_cannot_be_rendered_costs_the_page_not_the_incident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hangwatchd.daemon.make_incident import write_pages
    from hangwatchd.incidents.store import Store
    from hangwatchd.model import Incident
    from hangwatchd.report import html

    def broken(*_args: object) -> dict[str, str]:
        raise RuntimeError("a renderer bug")

    monkeypatch.setattr(html, "pages", broken)
    store = Store(tmp_path)
    store.open()
    draft = store.begin("manual", None, [])
    incident = Incident(id=draft.id, time=draft.time, host="h", reason="manual", detail="d", job=None, processes=())
    write_pages(draft.path, incident, {"summary": "s"})
    store.commit(draft, incident, "summary")
    (inc,) = store.list()
    assert inc["complete"] and (Path(inc["dir"]) / "incident.json").is_file()
    assert not (Path(inc["dir"]) / "report.html").exists()


def test_the_latest_incident_series_is_one_per_reason_and_job() -> None:
    from prometheus_client import generate_latest

    from hangwatchd import metrics

    m = metrics.create()
    m.incident_stored("A", "heartbeat", "train", 1.0)
    m.incident_stored("B", "heartbeat", "train", 2.0)
    m.incident_stored("C", "stack", None, 3.0)
    out = generate_latest(m.registry).decode()
    series = [ln for ln in out.splitlines() if ln.startswith("hangwatchd_last_incident_timestamp_seconds{")]
    assert len(series) == 2 and 'incident="B"' in "".join(series) and 'incident="A"' not in out
    for i in range(metrics.LAST_INCIDENT_SERIES + 5):
        m.incident_stored(f"id{i}", "heartbeat", f"job{i}", float(i))
    out = generate_latest(m.registry).decode()
    assert out.count("hangwatchd_last_incident_timestamp_seconds{") == metrics.LAST_INCIDENT_SERIES
