"""The hang catalogue's incidents, as a daemon stored them, read again by today's analysis.

``tests/fixtures/incidents/catalogue-cpu.tar.xz`` holds one incident per CPU hang class of
``bench/catalogue`` (``python -m bench.catalogue.keep``): real stacks with locals and native
frames, /proc facts, peers, exit events and the process's own report, from real processes
that hung the way users reported. The expected culprit and cause come from each class's
script, written from the report it cites. Here the analysis runs on them in this process, in
seconds: ``tests/test_catalogue.py`` runs the same classes live under a daemon.
"""

from __future__ import annotations

import json
import random
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.catalogue.cases import CPU_DIR, load
from bench.catalogue.score import RIGHT, score
from hangwatchd.analyze.verdict import analyze

from .conftest import extract

TARBALL = Path(__file__).resolve().parent / "fixtures" / "incidents" / "catalogue-cpu.tar.xz"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recorded")
    extract(TARBALL, root)
    return root


def _names() -> list[str]:
    with tarfile.open(TARBALL) as tar:
        return sorted({m.name.split("/", 1)[0] for m in tar.getmembers()})


CASES = _names()  # a class's name; "CLASS@VARIANT" where one is recorded again (another interpreter, another race)


def _class(case: str) -> str:
    return case.split("@", 1)[0]


def test_every_hang_class_of_the_catalogue_is_recorded() -> None:
    hangs = sorted(p.stem for p in CPU_DIR.glob("*.py") if not load(p).healthy)
    assert sorted({_class(c) for c in CASES}) == hangs


@pytest.mark.parametrize("case", CASES)
def test_a_recorded_hang_is_explained_as_its_report_says(recorded: Path, tmp_path: Path, case: str) -> None:
    expected = load(CPU_DIR / f"{_class(case)}.py")
    copy = tmp_path / case
    shutil.copytree(recorded / case, copy)
    summary = analyze(copy).summary
    assert score(summary, expected.culprit, expected.cause, expected.healthy).result == RIGHT, summary


def _files(recorded: Path) -> list[Path]:
    return sorted(p for p in recorded.rglob("*.json") if p.name != "incident.json")


_junk: Any = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                          lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
                          max_leaves=12)


def _mutate(value: Any, rnd: random.Random, junk: Any) -> Any:
    """One change somewhere in a JSON value: a key dropped, a value replaced, a list cut."""
    if isinstance(value, dict) and value:
        key = rnd.choice(sorted(value))
        if rnd.random() < 0.3:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: _mutate(value[key], rnd, junk)}
    if isinstance(value, list) and value:
        i = rnd.randrange(len(value))
        if rnd.random() < 0.3:
            return value[:i]
        return [*value[:i], _mutate(value[i], rnd, junk), *value[i + 1:]]
    return junk


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(pick=st.integers(0, 10**6), seed=st.integers(0, 2**32 - 1), junk=_junk, changes=st.integers(1, 6))
def test_a_recorded_incident_changed_anywhere_still_gets_a_verdict(recorded: Path, tmp_path_factory: pytest.TempPathFactory,
                                                                   pick: int, seed: int, junk: Any, changes: int) -> None:
    """Real evidence with a field dropped, replaced by junk or cut short anywhere (the process's own
    report, the stacks, the peers, the exits): the analysis says something, and never raises."""
    rnd = random.Random(seed)
    case = CASES[pick % len(CASES)]
    copy = tmp_path_factory.mktemp("mutated") / case
    shutil.copytree(recorded / case, copy)
    files = _files(copy)
    for _ in range(changes):
        f = rnd.choice(files)
        f.write_text(json.dumps(_mutate(json.loads(f.read_text()), rnd, junk)))
    summary = analyze(copy).summary
    assert isinstance(summary, str) and summary


def _replace_key(value: Any, key: str, new: Any) -> Any:
    if isinstance(value, dict):
        return {k: new if k == key else _replace_key(v, key, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_key(v, key, new) for v in value]
    return value


@pytest.mark.parametrize("syscall", [[None], {"name": "read"}, 7], ids=["a-list", "an-object", "a-number"])
def test_a_system_call_that_is_not_a_name_anywhere_in_a_recorded_incident_still_gets_a_verdict(
        recorded: Path, tmp_path: Path, syscall: Any) -> None:
    """What a thread is blocked in, as the capture wrote it (``blocked_on.syscall``), replaced in every
    file of every recorded case by something that is not a name (the fuzz above once drew a list: the
    analysis raised instead of judging)."""
    for case in CASES:
        copy = tmp_path / case
        shutil.copytree(recorded / case, copy)
        for f in _files(copy):
            f.write_text(json.dumps(_replace_key(json.loads(f.read_text()), "syscall", syscall)))
        assert analyze(copy).summary, case


def test_every_recorded_verdict_says_how_sure_it_is(recorded: Path) -> None:
    for case in CASES:
        a = analyze(recorded / case)
        said = [v.certainty for v in a.ranks if v.certainty]
        assert said and all(c.split(":")[0] in ("sure", "inferred", "unknown") for c in said), (case, said)
        assert any(c in line for c in said for line in a.rests_on), (case, a.rests_on)


def test_a_deadlock_read_from_the_process_s_own_answer_is_sure_and_from_stacks_alone_it_says_so(
        recorded: Path, tmp_path: Path) -> None:
    """The same two-lock deadlock, with and without the in-process report: the verdict names both
    threads either way; how sure it is, and from what, differs."""
    copy = tmp_path / "lock_order_two_threads"
    shutil.copytree(recorded / "lock_order_two_threads", copy)
    (with_report,) = [v for v in analyze(copy).ranks if v.certainty]
    assert with_report.verdict == "thread-deadlock" and with_report.certainty.startswith("sure:")
    assert "the process's own answer" in with_report.certainty
    for f in copy.rglob("introspect*.json"):
        f.unlink()
    (stacks_only,) = [v for v in analyze(copy).ranks if v.certainty]
    assert stacks_only.verdict == "thread-deadlock" and "the process's own answer" not in stacks_only.certainty
