"""Every real H200 dump gives what its README says a symboliser must find,
and agrees with cuda-gdb's reference answer on kernels, dims and PCs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hangwatchd.cudacore.symbolize import symbolize

from ..conftest import FIXTURES, hangwatchd


def sym(name: str) -> dict:
    res = hangwatchd("symbolize", "--json", str(FIXTURES / name / "coredump.nvcudmp.xz"))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def cuda_gdb(name: str) -> str:
    return (FIXTURES / name / "cuda-gdb.txt").read_text()


def frames_of(entry: dict) -> list[tuple[str | None, str | None, int | None]]:
    return [(f["function"], Path(f["file"]).name if f["file"] else None, f["line"]) for f in entry["frames"]]


def test_triton_hang_names_the_spinning_kernel_and_the_store_line() -> None:
    out = sym("triton_hang")
    (k,) = out["kernels"]
    assert k["name"] == "conditional_hang_kernel"
    assert (k["device"], k["grid_dim"], k["block_dim"], k["sms"]) == (0, [1, 1, 1], [128, 1, 1], [124])
    assert out["exceptions"] == []
    lines = {p["pc"]: frames_of(p) for p in out["pcs"]}
    # cuda-gdb's focus lane sits at 0x...9920: the tl.store of the while loop.
    assert lines["0x7f94137f9920"] == [("conditional_hang_kernel", "conditional_hang.py", 21)]
    assert sum(p["warps"] for p in out["pcs"]) == 5  # 4 warps, warp 0 split in two by divergence
    assert sum(p["lanes"] for p in out["pcs"]) == 128
    # cuda-gdb: the warps' active PC is 0x...9900, the focus lane's backtrace 0x...9920.
    gdb = cuda_gdb("triton_hang")
    assert set(lines) == {"0x7f94137f9900", "0x7f94137f9920"}
    assert "0x00007f94137f9900" in gdb and "0x00007f94137f9920" in gdb


def test_cpp_hang_has_warps_on_every_sm_of_the_kernel_and_the_inline_chain() -> None:
    out = sym("cpp_hang")
    (k,) = out["kernels"]
    assert k["name"] == "consumer_kernel(int volatile*, int*)"
    assert k["mangled"] == "_Z15consumer_kernelPViPi"
    assert (k["grid_dim"], k["block_dim"]) == ([4, 1, 1], [64, 1, 1])
    assert len(k["sms"]) == 4  # cuda-gdb lists only the focused SM 124
    (p,) = out["pcs"]
    assert p["sms"] == k["sms"] and p["warps"] == 8 and p["lanes"] == 256
    assert frames_of(p) == [
        ("wait_for(int volatile*)", "inlined.cu", 21),
        ("consumer_kernel(int volatile*, int*)", "inlined.cu", 25),
    ]
    assert "0x00007f82577a0040" in cuda_gdb("cpp_hang") and p["pc"] == "0x7f82577a0040"


def test_cpp_ima_exception_at_the_error_pc_with_the_whole_chain() -> None:
    out = sym("cpp_ima")
    (e,) = out["exceptions"]
    assert e["type"] == "WARP_ILLEGAL_ADDRESS"
    assert (e["device"], e["sm"], e["warp"]) == (0, 124, 0)
    assert e["lanes"] == list(range(32))
    # The fault is at the warp table's error PC, not the current PC (0x...c0).
    assert e["pc"] == "0x7fb56b7a00b0" and e["error_pc_valid"] is True
    assert "0x7fb56b7a00b0" in cuda_gdb("cpp_ima")
    assert e["kernel"] == "faulty_epilogue_kernel(int*, long)"
    assert [(fn, line) for fn, _file, line in frames_of(e)] == [
        ("store_at(int*, long, int)", 9),
        ("epilogue(int*, long, int)", 13),
        ("faulty_epilogue_kernel(int*, long)", 17),
    ]


def test_torch_ima_names_the_pytorch_kernel_without_line_info() -> None:
    out = sym("torch_ima")
    (k,) = out["kernels"]
    assert k["mangled"].startswith("_ZN2at6native24index_elementwise_kernelILi128ELi4E")
    assert k["name"].startswith("void at::native::index_elementwise_kernel<128, 4, ")
    (e,) = out["exceptions"]
    assert e["type"] == "WARP_ILLEGAL_ADDRESS" and e["pc"] == "0x7f96937acfd0"
    assert e["frames"] == [{"function": k["name"], "file": None, "line": None}]
    assert any("no line information" in n for n in out["notes"])
    gdb = cuda_gdb("torch_ima")
    assert "The exception was triggered at PC 0x7f96937acfd0" in gdb
    focus = re.search(r"^\*\s+3\s+\S+\s+\S+\s+(0x[0-9a-f]+)", gdb, re.M)
    assert focus and int(focus.group(1), 16) in {int(p["pc"], 16) for p in out["pcs"]}


@pytest.mark.parametrize("name", ["cpp_hang", "cpp_ima", "torch_ima", "triton_hang"])
def test_kernel_table_matches_cuda_gdb(name: str) -> None:
    out = sym(name)
    gdb = cuda_gdb(name)
    row = re.search(r"^\*\s+0\s+-\s+(\d+)\s+(\d+)\s+Active\s+\S+\s+\((\S+)\)\s+\((\S+)\)", gdb, re.M)
    assert row, gdb
    dev, _grid, gdim, bdim = row.groups()
    (k,) = out["kernels"]
    assert k["device"] == int(dev) and k["status"] == "active"
    assert k["grid_dim"] == [int(x) for x in gdim.split(",")]
    assert k["block_dim"] == [int(x) for x in bdim.split(",")]


def test_text_output_leads_with_the_exception_then_the_chain() -> None:
    res = hangwatchd("symbolize", str(FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz"))
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert text.index("Exception WARP_ILLEGAL_ADDRESS") < text.index("Kernel faulty_epilogue_kernel")
    chain = [text.index(f"inlined.cu:{n}") for n in (9, 13, 17)]
    assert chain == sorted(chain)


def test_without_nvdisasm_the_line_tables_still_give_every_chain() -> None:
    res = hangwatchd("symbolize", "--json", str(FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz"),
                     env={"HANGWATCHD_NVDISASM": "none"})
    assert res.returncode == 0, res.stderr
    (e,) = json.loads(res.stdout)["exceptions"]
    assert [f["line"] for f in e["frames"]] == [9, 13, 17]


def test_asked_for_nvdisasm_chains_without_nvdisasm_everything_else_still_works() -> None:
    res = hangwatchd("symbolize", "--json", "--chains", "nvdisasm", str(FIXTURES / "cpp_ima" / "coredump.nvcudmp.xz"),
                     env={"HANGWATCHD_NVDISASM": "none"})
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    (e,) = out["exceptions"]
    assert e["type"] == "WARP_ILLEGAL_ADDRESS" and e["pc"] == "0x7fb56b7a00b0"
    assert e["frames"] == [{"function": "faulty_epilogue_kernel(int*, long)", "file": None, "line": None}]
    assert any("nvdisasm not found" in n and "pip install nvidia-cuda-nvdisasm" in n for n in out["notes"])


WITH_LINES = ["cpp_hang", "cpp_ima", "triton_hang"]


@pytest.mark.parametrize("name", WITH_LINES)
def test_line_table_chains_agree_with_nvdisasm_at_every_warp_pc(name: str) -> None:
    """Two independent answers: our reader with nvdisasm out of reach, and nvdisasm alone."""
    dump = FIXTURES / name / "coredump.nvcudmp.xz"
    ours = symbolize(dump, nvdisasm=None)  # nothing to fall back on: a broken reader shows
    theirs = symbolize(dump, chains="nvdisasm")
    assert ours.notes == () and theirs.notes == ()
    pairs = list(zip(ours.pcs + ours.exceptions, theirs.pcs + theirs.exceptions))
    assert len(pairs) == len(ours.pcs + ours.exceptions) == len(theirs.pcs + theirs.exceptions) > 0
    for a, b in pairs:
        assert a.pc == b.pc
        assert (a.frames_from, b.frames_from) == ("line-table", "nvdisasm")
        assert a.frames[0].line is not None
        assert [(f.file, f.line) for f in a.frames] == [(f.file, f.line) for f in b.frames]
        assert a.frames[-1].function == b.frames[-1].function


@pytest.mark.parametrize("name", WITH_LINES)
def test_line_table_chains_agree_with_nvdisasm_at_every_instruction(name: str, raw_dumps: dict[str, Path]) -> None:
    """Every instruction of every loaded function with line information, not just where warps stood."""
    from hangwatchd.cudacore.cubin import Cubin
    from hangwatchd.cudacore.linetable import LineTable
    from hangwatchd.cudacore.nvdisasm import find_nvdisasm, line_table
    from hangwatchd.cudacore.reader import open_dump

    tool = find_nvdisasm()
    assert tool, "nvdisasm comes with the [test] extra (nvidia-cuda-nvdisasm)"
    compared = 0
    with open_dump(raw_dumps[name]) as dump:
        for module in {m.image.offset: m for m in dump.modules if m.image}.values():
            image = dump.image(module)
            table = LineTable(image)
            for fn in Cubin(image).functions:
                if not fn.has_line_info:
                    continue
                assert table.error is None
                theirs = line_table(tool, image, fn.symbol_index)
                assert theirs
                for pc, chain in theirs.items():
                    ours = [(loc.file, loc.line) for loc in table.chain_at(pc)]
                    assert ours == [(s.file, s.line) for s in chain], hex(pc)
                    compared += bool(chain)
    assert compared >= 24


def test_raw_gzip_and_zstd_dumps_give_the_same_answer(raw_dumps: dict[str, Path], tmp_path: Path) -> None:
    import gzip

    import zstandard

    raw = raw_dumps["cpp_hang"]
    gz = tmp_path / "d.nvcudmp.gz"
    gz.write_bytes(gzip.compress(raw.read_bytes()))
    zst = tmp_path / "d.nvcudmp.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(raw.read_bytes()))
    answers = [symbolize(p).to_dict() for p in (raw, gz, zst)]
    for a in answers:
        a.pop("path")
    assert answers[0] == answers[1] == answers[2]
