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


REPLAY = [driverlog.REPLAY_HEADER, '  File "/srv/gpuapp/graph_ima.py", line 32, in <module>', "    g.replay()"]


def test_the_reporters_word_on_the_last_graph_replay_after_the_traceback() -> None:
    report = driverlog.parse(RECORDED + REPLAY)
    assert report.replay == {"filename": "/srv/gpuapp/graph_ima.py", "line": 32, "name": "<module>", "code": "g.replay()"}
    assert [f["line"] for f in report.frames] == [33]  # the traceback stands as it was
    # Without its code line (no source), the frame is still read, and the next line is read as any other.
    cut = driverlog.parse(RECORDED + REPLAY[:2] + ["[1.0] coredump: All done"])
    assert cut.replay is not None and cut.replay["line"] == 32 and "code" not in cut.replay and cut.done
    # Before the driver's report it is nobody's word on a GPU error.
    assert driverlog.parse(REPLAY + RECORDED).replay is None


def test_a_traceback_without_a_driver_report_before_it_is_not_the_gpu_errors() -> None:
    tb = [i for i, line in enumerate(RECORDED) if line == driverlog.TRACEBACK][0]
    assert driverlog.parse(RECORDED[tb:]).frames == ()


LINE = st.one_of(st.sampled_from(RECORDED + REPLAY + [driverlog.TRACEBACK, '  File "x.py", line 9, in f', "    f()", ""]),
                 st.text(max_size=200))


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(LINE, max_size=200))
def test_fuzz_any_lines_read_to_a_report(lines: list[str]) -> None:
    report = driverlog.parse(lines)
    assert len(report.frames) <= len(lines)
    assert report.error is None or len(report.error) <= 500
    assert report.replay is None or len(report.replay.get("code", "")) <= 500
    report.summary()
