"""Inline chains from ``nvdisasm -ndf -c -gi``: for each instruction, the source
frames innermost first, exactly as the compiler recorded them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

INSTALL_HINT = "pip install nvidia-cuda-nvdisasm (or put a CUDA toolkit's nvdisasm on PATH)"
DEADLINE_S = 60.0

_LOC = re.compile(r'//## File "(?P<file>[^"]*)", line (?P<line>\d+)')
_INSN = re.compile(r"^\s*/\*(?P<addr>[0-9a-fA-F]+)\*/")


@dataclass(frozen=True)
class SourceLine:
    file: str
    line: int


def find_nvdisasm() -> str | None:
    """$HANGWATCHD_NVDISASM ('none' to go without), then a toolkit's (PATH, $CUDA_HOME), then the PyPI package's."""
    import glob
    import importlib.util

    from ..host import (
        subproc,  # here, not above: `symbolize` on a dump whose line tables answer never runs it
    )

    homes = [h for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if h]
    candidates = [os.path.join(h, "bin", "nvdisasm") for h in homes]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
    return subproc.find_tool("nvdisasm", "HANGWATCHD_NVDISASM", candidates)


class NvdisasmError(Exception):
    pass


def line_table(nvdisasm: str, image: bytes, symbol_index: int | None = None) -> dict[int, tuple[SourceLine, ...]]:
    """Map each instruction address of the cubin (or of one function) to its inline chain."""
    import tempfile

    from ..host import subproc

    with tempfile.NamedTemporaryFile(prefix="hangwatchd-", suffix=".cubin") as f:
        f.write(image)
        f.flush()
        argv = [nvdisasm, "-ndf", "-c", "-gi"]
        if symbol_index is not None:
            argv += ["-fun", str(symbol_index)]
        res = subproc.run(argv + [f.name], timeout=DEADLINE_S)
    if res.timed_out:
        raise NvdisasmError(f"nvdisasm took longer than {DEADLINE_S:.0f} s and was stopped")
    if res.returncode != 0:
        raise NvdisasmError(f"nvdisasm rejected the cubin: {res.stderr_line() or 'exit status ' + str(res.returncode)}")
    return parse(res.stdout.decode("utf-8", "replace"))


def parse(text: str) -> dict[int, tuple[SourceLine, ...]]:
    chains: dict[int, tuple[SourceLine, ...]] = {}
    chain: list[SourceLine] = []
    after_insn = True
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("//---"):
            chain, after_insn = [], True  # a new function: no location carries over
            continue
        loc = _LOC.search(line)
        if loc:
            if after_insn:
                chain, after_insn = [], False
            chain.append(SourceLine(loc["file"], int(loc["line"])))
            continue
        insn = _INSN.match(raw)
        if insn:
            chains[int(insn["addr"], 16)] = tuple(chain)
            after_insn = True
    return chains
