"""Attacks through the CUDA graph replay's word (the reporter's ``graph_replay``, the stderr tee's
REPLAY_HEADER frame) and the driver-log path it rides on: a root daemon, an attacker of uid 65534."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from hangwatchd.capture.dump_artifacts import MAX_TEXT
from hangwatchd.testing import ScratchDaemon, wait_for

from .conftest import FIXTURES, hangwatchd
from .test_security import (  # noqa: F401 - fixtures
    QUICK,
    Attacker,
    attacker,
    base,
    needs_root,
)


@needs_root
def test_a_planted_driver_log_with_a_huge_code_line_gives_an_incident_of_ordinary_size(base: Path, attacker: Attacker) -> None:
    """A driver log filed from the dump dir says where the error surfaced from its traceback's
    innermost frame: a code line there as long as the log may be is said in a line of a person's
    length, not copied whole into the incident's summary, the index and the daemon's log."""
    driver = (FIXTURES / "graph_ima" / "stderr.log").read_text().split("Traceback")[0]
    with ScratchDaemon(base / "d", config=QUICK) as d:
        attacker.run(f"""
import os
head = {driver!r} + 'Traceback (most recent call last):\\n  File "/srv/app/x.py", line 3, in <module>\\n    '
tail = '\\ntorch.AcceleratorError: CUDA error: an illegal memory access was encountered\\n'
tmp = os.path.join({str(d.dump_dir)!r}, '.evil')
with open(tmp, 'w') as f:
    f.write(head + 'x,' * (({MAX_TEXT} - len(head) - len(tail) - 64) // 2) + tail)
os.rename(tmp, os.path.join({str(d.dump_dir)!r}, 'nodump_{socket.gethostname()}.1.1.driver-log'))
""")
        inc = wait_for(lambda: [i for i in d.settled() if i["reason"] == "gpu-exception"], 120, "the planted report")[0]
        assert "surfaced in" in inc["summary"] and "x.py:3" in inc["summary"], inc["summary"][:300]
        assert len(inc["summary"]) < 2000, len(inc["summary"])
        assert d.proc.poll() is None


@pytest.mark.parametrize("threads", [7, [{"native_id": 1110, "graph_replay": {"function": "f", "file": ["x"], "line": 34}}]],
                         ids=["threads-a-number", "replay-file-a-list"])
def test_a_report_of_any_shape_costs_only_its_replays(tmp_path: Path, threads: object) -> None:
    """The process's own report is the user's to shape: ``"threads": 7``, or a replay whose file is a
    list, in introspect.json beside a real dump, real stacks and the line the capture read for them
    (code.json) leaves the verdict as the dump and stacks make it: the analysis of the incident (here
    ``hangwatchd analyze``) does not fail on it."""
    pdir = tmp_path / "1303"
    pdir.mkdir()
    (pdir / "proc.json").write_text(json.dumps({"pid": 1303}))
    shutil.copy(FIXTURES / "triton_hang" / "pyspy-native.json", pdir)
    shutil.copy(FIXTURES / "torch_ima" / "coredump.nvcudmp.xz", pdir)
    (pdir / "code.json").write_text(json.dumps({"lines": [{"file": "/srv/gpuapp/conditional_hang.py", "line": 34,
                                                           "code": "torch.cuda.synchronize()"}]}))
    (pdir / "introspect.json").write_text(json.dumps({"version": 1, "pid": 1303, "threads": threads}))
    res = hangwatchd("analyze", str(tmp_path), "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    (v,) = json.loads(res.stdout)["ranks"]
    assert v["verdict"] == "gpu-exception", v
    assert "surfaced in `torch.cuda.synchronize()` (conditional_hang.py:34)" in v["detail"], v["detail"]
