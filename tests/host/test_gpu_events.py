"""One XID is one event, however many reports of it come: NVML's event, the kernel log's line, a multi-line report."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hangwatchd.host import procfs
from hangwatchd.host.gpu_events import GpuEvent, GpuInfo, KernelXids, Recorder
from hangwatchd.testing import wait_for

from .test_kmsg import kmsg_record

XID13 = ["NVRM: Xid (PCI:0000:18:00): 13, pid={pid}, name=python3, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): "
         "Illegal Instruction Parameter",
         "NVRM: Xid (PCI:0000:18:00): 13, pid={pid}, name=python3, Graphics SM Global Exception on (GPC 7, TPC 7, SM 0): "
         "Multiple Warp Errors",
         "NVRM: Xid (PCI:0000:18:00): 13, pid={pid}, name=python3, Graphics Exception: ESR 0x57c730=0xc04000b 0x57c734=0x24"]


def test_the_kernel_logs_lines_and_nvmls_event_of_one_xid_are_one_event_named_with_its_process(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    rec = Recorder()
    rec.gpus[0] = 0
    rec.infos[0] = GpuInfo(0, 0, "GPU-fake-0", "1650000000", "0000:18:00")  # as NVML's listener found it
    posted: list[object] = []
    kernel = KernelXids(str(fifo), rec, posted.append)
    kernel.start()
    try:
        assert kernel.reader.ready.wait(10)
        nvml = rec.add(GpuEvent(time.time(), 0, 13, "GPU-fake-0", 0, pci="0000:18:00", recovery=0))  # NVML's, first
        with open(fifo, "wb") as w:
            for n, line in enumerate(XID13):  # the driver's three lines of one XID 13, naming this very process
                w.write(kmsg_record(n, line.format(pid=os.getpid())))
        wait_for(lambda: len(posted) == 3, 10, "the three lines read")
        with open(fifo, "wb") as w:  # another process's XID 31 on the same GPU, later: an event of its own
            w.write(kmsg_record(9, "NVRM: Xid (PCI:0000:18:00): 31, pid=1, name=init, Ch 00000008"))
        wait_for(lambda: len(posted) == 4, 10, "the next XID")
    finally:
        kernel.stop()
        kernel.reader.join(5)
    events = [m for m in posted if isinstance(m, GpuEvent)]
    assert not nvml.update and [e.update for e in events] == [True, True, True, False]  # counted: NVML's, then the 31
    xid13, xid31 = rec.events()
    assert (xid13.xid, xid13.source, xid13.pid, xid13.process, xid13.uuid, xid13.serial, xid13.recovery) == \
        (13, "nvml+kmsg", os.getpid(), "python3", "GPU-fake-0", "1650000000", 0)
    assert xid13.start_time == procfs.start_time(os.getpid()) and xid13.uid == os.geteuid()  # the process, not a bare pid
    assert xid13.kind == "application" and not xid13.node_fault
    assert (xid31.xid, xid31.gpu, xid31.pid, xid31.source) == (31, 0, 1, "kmsg")
