"""A section-heavy CUDA coredump made from a real one, shaped like NCCL's hang dumps.

NCCL's hung kernels leave hundreds of warps resident, and the driver writes
four sections per warp (``lntbl``, ``uregs``, ``upred``, ``cbu_bar``) and three
per lane (``regs``, ``pred``, ``bt``): 39,000 sections and more in the dumps of
issue 33, where the fixtures have 400 to 1,100. This takes a real dump (the
``cpp_hang`` fixture: ``consumer_kernel`` spinning on several SMs), keeps every
section of it, and gives each SM of device 0 that ran nothing a CTA of the same
grid with warps whose lanes stand where the real ones stand, each warp and lane
with its sections, named and linked as the driver does. The file is padded to
the size of the real ones with an image of no module (never read).

Used by ``tests/cudacore/test_section_heavy.py`` and ``bench/symbolize.py``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

EHDR_SHOFF, EHDR_SHNUM, EHDR_SHSTRNDX = 0x28, 0x3C, 0x3E
_SH = struct.Struct("<IIQQQQIIQQ")
_LOUSER = 0x80000000
REGS, RELF_IMG, BT, CTA_TABLE, WP_TABLE, LN_TABLE = (_LOUSER + n for n in (5, 7, 8, 13, 14, 15))
PRED, UREGS, UPRED, CBU_BAR = (_LOUSER + n for n in (17, 19, 20, 23))
GRID_TABLE = _LOUSER + 12
GRID_DIM_X = 72  # the grid table row's gridDimX (cudacoredump.h)
LANES = 32
REGS_PER_LANE = 255  # the most a thread has (NCCL's kernels use many): 1 KiB a lane


@dataclass(frozen=True)
class Made:
    data: bytes
    sections: int
    warps: int  # in the whole dump, the original's included
    added_warps: int


def _headers(dump: bytes) -> list[list[int]]:
    shoff = struct.unpack_from("<Q", dump, EHDR_SHOFF)[0]
    shnum = struct.unpack_from("<H", dump, EHDR_SHNUM)[0]
    return [list(_SH.unpack_from(dump, shoff + i * _SH.size)) for i in range(shnum)]


def section_heavy(dump: bytes, warps_per_sm: int = 3, pad_to: int = 123_000_000) -> Made:
    """``dump`` (a raw CUDA coredump with empty CTA tables on device 0's idle SMs) with
    ``warps_per_sm`` warps added on each of them, and padded to ``pad_to`` bytes."""
    heads = _headers(dump)
    shstrndx = struct.unpack_from("<H", dump, EHDR_SHSTRNDX)[0]
    names_off, names_size = heads[shstrndx][4], heads[shstrndx][5]
    old_names = dump[names_off : names_off + names_size]

    def name_of(h: list[int]) -> bytes:
        start = h[0]
        return old_names[start : old_names.index(b"\0", start)]

    # A warp that runs: its row, its lanes' rows, and the CTA it belongs to (grid, block).
    lntbl = next(h for h in heads if h[1] == LN_TABLE)
    wptbl = heads[lntbl[6]]
    ctatbl = heads[wptbl[6]]
    smtbl = heads[ctatbl[6]]
    warp_row = dump[wptbl[4] : wptbl[4] + wptbl[9]]
    lane_rows = dump[lntbl[4] : lntbl[4] + lntbl[5]]
    cta_row = dump[ctatbl[4] : ctatbl[4] + ctatbl[9]]
    idle = [i for i, h in enumerate(heads) if h[1] == CTA_TABLE and h[6] == ctatbl[6] and h[5] == 0]

    body = bytearray(dump)
    names = bytearray(old_names)
    new: list[list[int]] = []

    def add_name(text: str) -> int:
        at = len(names)
        names.extend(text.encode() + b"\0")
        return at

    def add_data(data: bytes) -> int:
        at = len(body)
        body.extend(data)
        return at

    def add(name: str, typ: int, data: bytes, link: int, info: int, entsize: int) -> int:
        new.append([add_name(name), typ, 2, 0, add_data(data), len(data), link, info, 0, entsize])
        return len(heads) + len(new) - 1

    sm_ids = [struct.unpack_from("<I", dump, smtbl[4] + row * smtbl[9])[0] for row in range(smtbl[5] // smtbl[9])]
    regs = bytes(4 * REGS_PER_LANE)
    added = 0
    for n, cta_index in enumerate(idle):
        sm_row = heads[cta_index][7]
        sm = f"dev0.sm{sm_ids[sm_row]}"
        # This SM's CTA table gets one row: a block of the same grid.
        row = bytearray(cta_row)
        struct.pack_into("<III", row, 8, 4 + n, 0, 0)  # blockIdx
        heads[cta_index][4], heads[cta_index][5] = add_data(bytes(row)), len(row)
        wp_rows = bytearray()
        for w in range(warps_per_sm):
            r = bytearray(warp_row)
            struct.pack_into("<I", r, 8, w)  # warpId
            wp_rows += r
        wp = add(f".cudbg.wptbl.{sm}.cta0", WP_TABLE, bytes(wp_rows), cta_index, 0, len(warp_row))
        for w in range(warps_per_sm):
            where = f"{sm}.cta0.wp{w}"
            add(f".cudbg.uregs.{where}", UREGS, bytes(256), wp, w, 4)
            add(f".cudbg.upred.{where}", UPRED, bytes(32), wp, w, 4)
            add(f".cudbg.cbu_bar.{where}", CBU_BAR, bytes(64), wp, w, 4)
            ln = add(f".cudbg.lntbl.{where}", LN_TABLE, lane_rows, wp, w, lntbl[9])
            for lane in range(LANES):
                add(f".cudbg.bt.{where}.ln{lane}", BT, b"", ln, lane, 24)
                add(f".cudbg.regs.{where}.ln{lane}", REGS, regs, ln, lane, 4)
                add(f".cudbg.pred.{where}.ln{lane}", PRED, bytes(32), ln, lane, 4)
            added += 1
    # The grid is as wide as its blocks now are.
    grid_id = struct.unpack_from("<Q", cta_row, 0)[0]
    for h in heads:
        if h[1] == GRID_TABLE and h[9] > GRID_DIM_X:
            for at in range(h[4], h[4] + h[5], h[9]):
                if struct.unpack_from("<Q", body, at)[0] == grid_id:
                    blocks = struct.unpack_from("<I", body, at + GRID_DIM_X)[0]
                    struct.pack_into("<I", body, at + GRID_DIM_X, blocks + len(idle))
    total = len(heads) + len(new)
    original_warps = sum(h[5] // h[9] for h in heads if h[1] == WP_TABLE and h[9])
    padding = pad_to - len(body) - len(names) - 64 * total
    if padding > 0:  # an image no module row names: the size of NCCL's cubins, never read
        new.append([add_name(".cudbg.relfimg.dev1.ctx0"), RELF_IMG, 2, 0, len(body), padding, 0, 0, 0, 0])
        body.extend(bytes(padding))
        total += 1
    # The name table, every name old and new, where the old one's header points.
    heads[shstrndx][4], heads[shstrndx][5] = add_data(bytes(names)), len(names)
    if total > 0xFF00:
        raise ValueError(f"{total} sections need ELF's extended numbering; ask for fewer warps")
    shoff = len(body)
    for h in heads + new:
        body += _SH.pack(*h)
    struct.pack_into("<Q", body, EHDR_SHOFF, shoff)
    struct.pack_into("<H", body, EHDR_SHNUM, total)
    return Made(bytes(body), total, original_warps + added, added)
