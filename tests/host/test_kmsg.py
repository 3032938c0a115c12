"""The kernel log reader: real NVRM Xid lines of many drivers, through a FIFO, a real /dev/kmsg, and any bytes at all."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatchd.host import kmsg, xid
from hangwatchd.host.kmsg import KernelLog, Lines, parse_record
from hangwatchd.testing import wait_for

# Lines as drivers wrote them (issues and bug reports of the NVIDIA driver, NVSentinel, gpud; docs/gpu-evidence.md
# names them), each with what must be read from it: (pci, xid, pid, name, cause, recovery, kind).
FIELD_LINES = [
    # On an H200 (driver 580, 2026-12-01): tests/gpu/run_xid.py's faulting process, read back with dmesg.
    ("NVRM: Xid (PCI:0000:00:06): 31, pid=550, name=python3, channel 0x0000001e, intr 00000000. MMU Fault: ENGINE GRAPHICS "
     "GPC4 GPCCLIENT_T1_8 faulted @ 0x7ff1_14a00000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE",
     ("0000:00:06", 31, 550, "python3", None, None, "application")),
    ("NVRM: Xid (PCI:0000:18:00): 31, pid=2149, name=python3, Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS "
     "GPCCLIENT_T1_0 faulted @ 0x7f2c_1e000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
     ("0000:18:00", 31, 2149, "python3", None, None, "application")),
    ("NVRM: Xid (PCI:0000:b5:00): 31, pid=2079991, name=pt_main_thread, Ch 00000008, intr 00000000. MMU Fault: ...",
     ("0000:b5:00", 31, 2079991, "pt_main_thread", None, None, "application")),
    ("NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): "
     "Illegal Instruction Parameter", ("0000:cb:00", 13, None, None, None, None, "application")),
    ("NVRM: Xid (PCI:0000:0a:00): 43, pid=13332, name=cuda_plot_k32_v, Ch 00000010",
     ("0000:0a:00", 43, 13332, "cuda_plot_k32_v", None, None, "application")),
    ("NVRM: Xid (PCI:0000:0a:00): 45, pid='<unknown>', name=<unknown>, Ch 00000008",
     ("0000:0a:00", 45, None, None, None, None, "application")),
    # A channel ended because the GPU failed: the kind of its cause, not an application's.
    ("NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
     ("0000:dc:00", 45, 1818990, "python3", 149, None, "gpu")),
    ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1032, name=python, An uncorrectable double bit error (DBE) has been detected on GPU",
     ("0000:3b:00", 48, 1032, "python", None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
     ("0000:10:1c", 63, 1896, None, None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:65:00): 64, pid='N/A', Row Remapper: Failed to remap row",
     ("0000:65:00", 64, None, None, None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:86:00): 74, pid=33561, name=python, NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
     ("0000:86:00", 74, 33561, "python", None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus.", ("0000:44:00", 79, None, None, None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1032, GPU has fallen off the bus.", ("0000:3b:00", 79, 1032, None, None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:9b:00): 92, pid='<unknown>', name=<unknown>, High single-bit ECC error rate",
     ("0000:9b:00", 92, None, None, None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:9b:00): 94, pid=1234, name=python3, Contained ECC error",
     ("0000:9b:00", 94, 1234, "python3", None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:9b:00): 95, pid=1234, name=python3, Uncontained ECC error",
     ("0000:9b:00", 95, 1234, "python3", None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
     ("0000:cb:00", 109, 1797828, "pt_main_thread", None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:c1:00): 119, pid=91012, name=nvidia-smi, Timeout after 6s of waiting for RPC response from GPU0 GSP! "
     "Expected function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).", ("0000:c1:00", 119, 91012, "nvidia-smi", None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:c1:00): 120, pid='<unknown>', name=<unknown>, GSP task timeout @ pc:0x4bd36a4, partition:0#0, "
     "task:3(RISC-V Scheduler)", ("0000:c1:00", 120, None, None, None, None, "gpu")),
    ("NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
     ("0019:01:00", 149, None, None, None, None, "gpu")),
    ("NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
     ("0000:01:00", 154, None, None, None, 1, "gpu")),
    ("NVRM: Xid (0000:03:00): 13, 0001 00000000 0000a097 00001b0c 00001000 00000000",
     ("0000:03:00", 13, None, None, None, None, "application")),
]
NOT_XIDS = ["NVRM: GPU at PCI:0000:0a:00: GPU-760d0170-b7c5-6817-9414-6cc7112645de",
            "NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has",
            "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context", "NVRM: Xid (PCI:zz): 31, pid=1",
            # Any user's text in the kernel's own line: a segfault names the file mapped where it happened.
            "python3[27598]: segfault at 7f5930713000 ip 00007f5930713000 sp 00007ffc7d0d2398 error 15 in NVRM: Xid "
            "(PCI:0000:18:00): 79, pid=1234, name=python3, GPU has fallen off the bus.[0,7f5930713000+1000] likely on CPU 0",
            "NVRM: Xid (PC[1]: segfault at 0 ip 0 sp 0 error 15 in NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus."]


@pytest.mark.parametrize(("line", "facts"), FIELD_LINES, ids=[f"xid-{f[1]}-{i}" for i, (_, f) in enumerate(FIELD_LINES)])
def test_each_drivers_xid_line_is_read_with_its_process_and_whose_fault_it_is(line: str, facts: tuple) -> None:
    found = xid.parse_line(line)
    assert found is not None
    assert (found.pci, found.xid, found.pid, found.name, found.cause, found.recovery, found.kind) == facts
    assert len(found.detail) <= xid.MAX_DETAIL


@pytest.mark.parametrize("line", NOT_XIDS)
def test_other_kernel_lines_are_not_xids(line: str) -> None:
    assert xid.parse_line(line) is None


def test_nvidias_catalogue_sorts_the_xids_the_issue_names() -> None:
    assert {n for n in (13, 31, 43, 45) if xid.kind(n) == xid.APPLICATION} == {13, 31, 43, 45}
    assert {n for n in (48, 63, 64, 74, 79, 92, 94, 95, 109, 119, 120) if xid.kind(n) == xid.GPU} == \
        {48, 63, 64, 74, 79, 92, 94, 95, 109, 119, 120}
    assert xid.kind(9999) == xid.UNKNOWN and xid.describe(9999) == "an XID error"
    assert [n for n in (13, 31, 48, 79, 94, 95, 119) if xid.needs_reset(n)] == [48, 79, 95, 119]
    assert xid.pci_key("00000000:18:00.0") == xid.pci_key("PCI:0000:18:00") == xid.pci_key("0000:18:00.0") == "0000:18:00"


def kmsg_record(seq: int, message: str, usec: int | None = None) -> bytes:
    """A record as /dev/kmsg writes it: PRIO,SEQ,USEC,FLAGS;MESSAGE, then its dictionary lines."""
    usec = time.monotonic_ns() // 1000 if usec is None else usec
    return f"4,{seq},{usec},-;{message}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:18:00.0\n".encode()


def test_a_record_is_read_as_dev_kmsg_writes_it() -> None:
    rec = parse_record(b"4,1234,5678901,-;NVRM: Xid (PCI:0000:18:00): 31, pid=1, name=x, Ch 1")
    assert rec is not None and rec.seq == 1234 and rec.usec == 5678901 and rec.message.startswith("NVRM: Xid")
    assert parse_record(b" SUBSYSTEM=pci") is None  # a dictionary line
    assert parse_record(b"[ 1843.30] NVRM: plain dmesg text") == kmsg.Record("[ 1843.30] NVRM: plain dmesg text")
    # Its time: the kernel's monotonic clock carried over to wall-clock time, never in the future.
    assert kmsg.wall_time(10_000_000, now=1000.0, mono=12.0) == 998.0
    assert kmsg.wall_time(99_000_000, now=1000.0, mono=12.0) == 1000.0


@pytest.mark.skipif(os.geteuid() != 0, reason="reading /dev/kmsg needs root (CAP_SYSLOG where kernel.dmesg_restrict = 1)")
def test_the_real_dev_kmsg_gives_records_in_the_format_read_here() -> None:
    if not os.path.exists("/dev/kmsg"):
        pytest.skip("this system has no /dev/kmsg")
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        raw = os.read(fd, kmsg.READ_SIZE)  # the oldest record still kept: one read, one record
    finally:
        os.close(fd)
    first = raw.split(b"\n")[0]
    rec = parse_record(first)
    assert rec is not None and rec.seq is not None and rec.usec is not None, raw[:200]
    assert raw.endswith(b"\n")


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "kmsg"
    os.mkfifo(path)
    yield path


def follow(path: Path, **kw: object) -> tuple[KernelLog, list[tuple[xid.XidLine, float]]]:
    seen: list[tuple[xid.XidLine, float]] = []
    reader = KernelLog(str(path), lambda line, when: seen.append((line, when)), poll_ms=50, **kw)  # type: ignore[arg-type]
    reader.start()
    assert reader.ready.wait(10)
    return reader, seen


def test_lines_written_into_a_fifo_come_out_as_xids_with_their_time_and_writers_may_come_and_go(fifo: Path) -> None:
    reader, seen = follow(fifo)
    try:
        before = time.time()
        with open(fifo, "wb") as w:
            w.write(kmsg_record(1, "usb 1-1: new high-speed USB device"))  # not an XID: skipped
            w.write(kmsg_record(2, FIELD_LINES[1][0]))
        wait_for(lambda: len(seen) == 1, 10, "the first XID")
        with open(fifo, "wb") as w:  # a second writer, after the first left: still read
            record = kmsg_record(3, FIELD_LINES[11][0])
            w.write(record[:17])  # a record cut across two writes is one record
            w.flush()
            time.sleep(0.2)
            w.write(record[17:])
        wait_for(lambda: len(seen) == 2, 10, "the second XID")
    finally:
        reader.stop()
        reader.join(5)
    assert not reader.is_alive()
    assert [(line.xid, line.pid) for line, _ in seen] == [(31, 2149), (79, None)]
    assert all(before - 1 <= when <= time.time() for _, when in seen)


def test_an_overrun_of_the_ring_buffer_is_counted_and_reading_goes_on(fifo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_read = os.read
    calls = {"n": 0}

    def read(fd: int, n: int) -> bytes:  # the kernel's answer to a reader the ring buffer overtook: EPIPE, once
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EPIPE, "Broken pipe")
        return real_read(fd, n)

    monkeypatch.setattr(kmsg.os, "read", read)
    reader, seen = follow(fifo)
    try:
        with open(fifo, "wb") as w:
            w.write(kmsg_record(7, FIELD_LINES[4][0]))
            w.flush()
            wait_for(lambda: seen, 10, "the XID after the overrun")
    finally:
        reader.stop()
        reader.join(5)
    assert reader.overruns == 1 and seen[0][0].xid == 43


def test_a_log_that_cannot_be_opened_says_why_and_is_tried_again(tmp_path: Path) -> None:
    path = tmp_path / "not-yet"
    reader, seen = follow(path, reopen_s=0.1)
    try:
        assert reader.unavailable and "cannot read" in reader.unavailable
        os.mkfifo(path)
        wait_for(lambda: reader.unavailable is None, 10, "the log opened once it is there")
        with open(path, "wb") as w:
            w.write(kmsg_record(1, FIELD_LINES[7][0]))
        wait_for(lambda: seen, 10, "the XID")
    finally:
        reader.stop()
        reader.join(5)


# -- any bytes at all ---------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=12), st.integers(min_value=1, max_value=64))
def test_any_bytes_in_any_chunks_make_bounded_lines_and_never_raise(chunks: list[bytes], max_line: int) -> None:
    lines = Lines(max_line)
    out = [line for c in chunks for line in lines.feed(c)] + list(lines.flush())
    assert all(len(line) <= max_line and b"\n" not in line for line in out)
    for line in out:
        rec = parse_record(line)
        if rec is not None:
            xid.parse_line(rec.message)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=600))
def test_any_text_is_an_xid_line_or_none(text: str) -> None:
    found = xid.parse_line(text)
    if found is not None:
        assert xid.pci_key(found.pci) == found.pci and len(found.detail) <= xid.MAX_DETAIL
        assert found.name is None or len(found.name) <= 64
        assert found.kind in (xid.APPLICATION, xid.GPU, xid.UNKNOWN)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.binary(max_size=2000), st.lists(st.integers(min_value=0, max_value=4000), max_size=6))
def test_a_real_xid_line_between_any_bytes_cut_anywhere_is_found(noise_before: bytes, noise_after: bytes, cuts: list[int]) -> None:
    data = noise_before + b"\n" + kmsg_record(5, FIELD_LINES[1][0], usec=1) + noise_after
    lines, found, at = Lines(), [], 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        found += [xid.parse_line(r.message) for r in map(parse_record, lines.feed(data[at:cut])) if r is not None]
        at = cut
    assert any(f is not None and f.xid == 31 and f.pid == 2149 for f in found)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(min_size=1, max_size=20_000), min_size=1, max_size=4))
def test_the_reader_survives_any_bytes_through_a_fifo_and_still_reads_the_next_xid(tmp_path: Path, junk: list[bytes]) -> None:
    path = tmp_path / f"kmsg-{threading.get_ident()}-{time.monotonic_ns()}"
    os.mkfifo(path)
    reader, seen = follow(path)
    try:
        with open(path, "wb") as w:
            for chunk in junk:
                w.write(chunk)
            w.write(b"\n" + kmsg_record(9, FIELD_LINES[15][0]))
        wait_for(lambda: any(line.xid == 95 for line, _ in seen), 10, "the XID after the junk")
        assert reader.is_alive()
    finally:
        reader.stop()
        reader.join(5)
        path.unlink()
