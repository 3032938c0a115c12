"""`hangwatchd incidents` and `show` over the whole index, as a person runs them: every stored
incident within reach (paged, filtered in the query), and the index's faults named for what they
are. With 1,500 stored: past the 1,000 the listing used to stop at, silently."""

from __future__ import annotations

import datetime
import json
import shlex
from pathlib import Path

import pytest

from ..conftest import hangwatchd
from .many import fill

COUNT = 1500
EVERY = 60.0  # seconds between two incidents


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """1,500 incidents a minute apart, the newest now, of jobs train and eval in turn; ids oldest first."""
    state = tmp_path_factory.mktemp("many") / "state"
    return state, fill(state, COUNT, every=EVERY, jobs=("train", "eval"), file_bytes=0)


def cli(state: Path, *args: str) -> tuple[int, str, str]:
    res = hangwatchd(*args, "--state-dir", str(state), "--runtime-dir", str(state.parent / "run"))
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, res.stdout, res.stderr


def rows(table: str) -> list[str]:
    """The ids of a text listing, in order (the header and the closing line left out)."""
    return [line.split()[0] for line in table.splitlines() if line[:8].isdigit() and line[8] == "T"]


def test_every_stored_incident_is_reached_page_by_page_newest_first(stored: tuple[Path, list[str]]) -> None:
    state, ids = stored
    code, out, _ = cli(state, "incidents")
    assert code == 0
    assert rows(out) == ids[::-1][:100]  # the newest 100 by default
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"{COUNT - 100} older incidents not listed") and f"--before {ids[-100]}" in last
    # Following what each page says is next, with bigger pages, reaches every one, each once.
    seen, argv = [], ["incidents", "--limit", "400"]
    while True:
        code, out, _ = cli(state, *argv)
        assert code == 0
        seen += rows(out)
        last = out.strip().splitlines()[-1]
        if "not listed" not in last:
            break
        command = shlex.split(last.split("the next: ", 1)[1])
        assert command[:2] == ["hangwatchd", "incidents"]
        assert command[command.index("--state-dir") + 1] == str(state)
        argv = ["incidents", *command[2:]]  # cli() gives the dirs again: the later ones count, the same
    assert seen == ids[::-1]


def test_limit_0_lists_all_and_json_says_what_is_left_out_on_stderr(stored: tuple[Path, list[str]]) -> None:
    state, ids = stored
    code, out, err = cli(state, "incidents", "--json", "--limit", "10")
    assert code == 0 and [i["id"] for i in json.loads(out)] == ids[::-1][:10]
    assert f"{COUNT - 10} older incidents not listed" in err
    code, out, err = cli(state, "incidents", "--json", "--limit", "0")
    assert [i["id"] for i in json.loads(out)] == ids[::-1] and err == ""


def test_the_job_is_chosen_in_the_query_before_the_limit(stored: tuple[Path, list[str]]) -> None:
    state, ids = stored
    evals = [i for n, i in enumerate(ids) if n % 2 == 1]
    code, out, _ = cli(state, "incidents", "--json", "--limit", "0", "--job", "eval")
    listed = json.loads(out)
    assert [i["id"] for i in listed] == evals[::-1] and {i["job"] for i in listed} == {"eval"}
    code, out, _ = cli(state, "incidents", "--job", "eval", "--limit", "5")
    assert rows(out) == evals[::-1][:5] and f"{len(evals) - 5} older incidents not listed" in out
    code, out, _ = cli(state, "incidents", "--job", "nosuchjob")
    assert code == 0 and out.strip() == f"no incidents in {state} for job nosuchjob"


def test_since_takes_a_time_or_an_age(stored: tuple[Path, list[str]]) -> None:
    state, ids = stored
    times = {i["id"]: i["time"] for i in json.loads(cli(state, "incidents", "--json", "--limit", "0")[1])}
    # A time between the 50th and the 51st newest: exactly 50, whichever way it is written.
    cut = times[ids[-50]] - EVERY / 2
    utc = datetime.datetime.fromtimestamp(cut, datetime.timezone.utc)
    for written in (utc.isoformat(), utc.strftime("%Y-%m-%dT%H:%M:%S.%f"), utc.astimezone(
            datetime.timezone(datetime.timedelta(hours=2))).isoformat()):
        code, out, _ = cli(state, "incidents", "--json", "--limit", "0", "--since", written)
        assert [i["id"] for i in json.loads(out)] == ids[::-1][:50], written
    # An age: about 90 of them in the last 90 minutes.
    code, out, _ = cli(state, "incidents", "--json", "--limit", "0", "--since", "90m")
    assert 89 <= len(json.loads(out)) <= 91
    code, out, err = cli(state, "incidents", "--since", "last tuesday")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--since" in err


def test_show_finds_the_oldest_of_1500_by_id_or_prefix(stored: tuple[Path, list[str]]) -> None:
    state, ids = stored
    code, out, err = cli(state, "show", ids[0])
    assert code == 0, err
    assert f"Incident {ids[0]}" in out
    code, out, _ = cli(state, "show", ids[0][:-2])  # a prefix only it has
    assert code == 0 and f"Incident {ids[0]}" in out
    code, _, err = cli(state, "show", ids[0][:8])  # a day's worth of them
    assert code == 2 and "no incident" in err


def test_a_state_dir_that_does_not_exist_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for argv in (["incidents"], ["incidents", "--json"], ["show", "20261129T19"]):
        res = hangwatchd(*argv, "--state-dir", "/nonexistent/hangwatchd")
        assert res.returncode == 2 and res.stdout == "", (argv, res.stdout, res.stderr)
        (line,) = res.stderr.strip().splitlines()
        assert line == ("hangwatchd: state dir /nonexistent/hangwatchd does not exist; pass --state-dir with the "
                        "daemon's state dir ('hangwatchd status' names it)")


def test_a_corrupt_index_is_called_corrupt_and_the_cure_is_named(tmp_path: Path) -> None:
    state = tmp_path / "state"
    fill(state, 3, file_bytes=0)
    (state / "index.sqlite").write_bytes(b"this is no database, it is a napkin" * 200)
    for argv in (["incidents"], ["show", "2026"]):
        code, out, err = cli(state, *argv)
        assert code == 1 and out == ""
        (line,) = err.strip().splitlines()
        assert f"the incident index {state / 'index.sqlite'} is corrupt" in line
        assert "rebuilds it from the incident directories when it starts" in line and "df " not in line


def test_a_missing_index_beside_stored_incidents_is_named(tmp_path: Path) -> None:
    state = tmp_path / "state"
    fill(state, 3, file_bytes=0)
    (state / "index.sqlite").unlink()
    code, out, err = cli(state, "incidents")
    assert code == 1 and out == ""
    (line,) = err.strip().splitlines()
    assert "is missing, while incidents are stored in" in line and "rebuilds it" in line
    # A fresh state dir, never used: nothing stored, nothing wrong.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    code, out, err = cli(fresh, "incidents")
    assert code == 0 and out.strip() == f"no incidents in {fresh}" and err == ""


# What `incidents` and `show` must never load: the daemon's logging, metrics, detectors and store
# writer (a person waits for these commands; docs/speed.md has the figures, bench/incidents_scale.py).
NOT_FOR_READING = ("structlog", "prometheus_client", "boto3", "hangwatchd.metrics", "hangwatchd.incidents.store",
                   "hangwatchd.incidents.spool", "hangwatchd.detect.base", "hangwatchd.watch.watched", "hangwatchd.daemon")


@pytest.mark.parametrize("argv", [["incidents"], ["incidents", "--json", "--job", "eval", "--since", "2h"], ["show"]])
def test_incidents_and_show_import_only_the_index_and_what_they_print(stored: tuple[Path, list[str]],
                                                                     argv: list[str]) -> None:
    import subprocess
    import sys

    state, ids = stored
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "hangwatchd", *argv,
                          *([ids[0]] if argv == ["show"] else []), "--state-dir", str(state)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    mods = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "hangwatchd.incidents.index" in mods
    assert sorted(m for m in NOT_FOR_READING if m in mods) == []
    if argv[0] == "incidents":
        assert "dataclasses" not in mods and "hangwatchd.analyze" not in mods
