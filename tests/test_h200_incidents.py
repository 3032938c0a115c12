"""Incidents the daemon stored on an H200, read again by today's analysis.

Each folder under ``tests/fixtures/incidents/h200-CASE`` is an incident as the
daemon stored it while ``python -m bench.catalogue --gpu`` ran the GPU class
``bench/catalogue/gpu/CASE.py`` on an H200 (``tests/gpu/run_device.sh
catalogue``; the coredumps left out, their symbolised answers kept). The
expected culprit and cause come from the case script, written from the bug
reports it cites, not from what the analyser says.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.catalogue.cases import GPU_DIR, load
from bench.catalogue.score import RIGHT, score
from hangwatchd.analyze.verdict import analyze

HERE = Path(__file__).resolve().parent / "fixtures" / "incidents"


def _analysed(tmp_path: Path, name: str) -> str:
    copy = tmp_path / name
    shutil.copytree(HERE / name, copy)  # analyze writes nothing, but a fixture is never the one touched
    return analyze(copy).summary


@pytest.mark.parametrize("case", ["gpu_kernel_spins_on_flag", "gpu_sync_while_gil_held"])
def test_a_gpu_hang_stored_on_an_h200_is_explained_as_its_report_says(tmp_path: Path, case: str) -> None:
    expected = load(GPU_DIR / f"{case}.py")
    summary = _analysed(tmp_path, f"h200-{case}")
    assert score(summary, expected.culprit, expected.cause, expected.healthy).result == RIGHT, summary


def test_another_process_s_illegal_address_is_not_taken_for_the_cause_of_a_stream_that_waits(tmp_path: Path) -> None:
    """On the H200 the stream-wait class ran beside one that hit an illegal address (XID 31) 4 s
    earlier; the kernel's XID was the other process's. The verdict says what this process waits
    for (no kernel of its own runs) at its own line, and the XID only as another's."""
    summary = _analysed(tmp_path, "h200-gpu_stream_waits_value_never_written")
    first = summary.split(". ")[0]
    assert "no kernel running on GPU 0" in first and "gpu_stream_waits_value_never_written.py:50" in first
    assert "XID" not in first and "a GPU fault, not the program" not in summary
    # Its host is in cuKernelGetFunction: the matmul's launch loading its kernel, which waits behind the stream.
    assert "host blocked in cuKernelGetFunction (loading a kernel at its first launch: CUDA's lazy loading" in first, first


def test_a_slow_rank_whose_synchronise_spins_is_named_gpu_bound_from_its_h200_record(tmp_path: Path) -> None:
    """tests/gpu/run_slow.py on an H200: four ranks of one job share the GPU, rank 2 launches 24 more
    matrix products a step. The daemon of that run named rank 2 and called it CPU-bound (its
    synchronise spun while it waited); the record says it waits in GPU calls, not in its own Python."""
    summary = _analysed(tmp_path, "h200-slow-gpu-bound")
    assert "rank 2 on vm holds it back" in summary, summary
    assert "it waits for its own GPU work 96% of the time (the other ranks 75%)" in summary, summary
    assert "goes to waiting for the GPU (a synchronise that spins)" in summary and "CPU-bound" not in summary, summary
