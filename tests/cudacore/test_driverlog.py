"""The driver's coredump: lines and the traceback after them, as a workload's stderr gives them
(user-written text): the recorded graph_ima stderr reads as what it says; anything else reads to
a report or to nothing, never an exception, and keeps no more than it was given."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatchd.cudacore import driverlog

from ..conftest import FIXTURES

RECORDED = (FIXTURES / "graph_ima" / "stderr.log").read_text().splitlines()


def test_the_recorded_report_and_the_traceback_the_program_died_of() -> None:
    report = driverlog.parse(RECORDED)
    assert (report.exception, report.device, report.sm, report.warp) == ("WARP_ILLEGAL_ADDRESS", 0, 0, 5)
    assert report.dump_file is None and not report.done  # it wrote no dump
    assert [(f["filename"], f["line"], f["name"], f.get("code")) for f in report.frames] == [
        ("/srv/gpuapp/graph_ima.py", 33, "<module>", "print(out.sum().item())")]
    assert report.error is not None and report.error.startswith("torch.AcceleratorError: CUDA error: an illegal memory access")


def test_a_traceback_without_a_driver_report_before_it_is_not_the_gpu_errors() -> None:
    tb = [i for i, line in enumerate(RECORDED) if line == driverlog.TRACEBACK][0]
    assert driverlog.parse(RECORDED[tb:]).frames == ()


LINE = st.one_of(st.sampled_from(RECORDED + [driverlog.TRACEBACK, '  File "x.py", line 9, in f', "    f()", ""]),
                 st.text(max_size=200))


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(LINE, max_size=200))
def test_fuzz_any_lines_read_to_a_report(lines: list[str]) -> None:
    report = driverlog.parse(lines)
    assert len(report.frames) <= len(lines)
    assert report.error is None or len(report.error) <= 500
    report.summary()
