"""The job side as one file, ``hangwatchd-job.pyz``: what a job's own environment runs, and nothing else.

A job needs ``hangwatchd run`` (the launcher), ``hangwatchd.beat()`` and
``hangwatchd.register()``: these modules, Python 3.9 or later, no third-party
package (tests/test_job_side.py holds them to that). The bundle is a zipapp of
exactly them::

    python3 hangwatchd-job.pyz run --job train -- torchrun --nproc-per-node 8 train.py

and ``hangwatchd run`` started from it puts it on the workload's PYTHONPATH, so
``import hangwatchd; hangwatchd.beat()`` works in the job with nothing installed.
The sidecar image carries one (``/opt/hangwatchd/job/hangwatchd-job.pyz``) for an
init container to copy into the pod (deploy/kubernetes/pod.yaml); ``./dev wheel``
makes one beside the wheel. Build one: ``python -m hangwatchd.workload.bundle OUT``.
"""

from __future__ import annotations

import io
import os
import sys
import zipfile
from pathlib import Path

from ..host.atomic import write_atomic

NAME = "hangwatchd-job.pyz"

# Every module the job side imports, lazily or not, relative to the package (its __init__s too).
JOB_SIDE = (
    "__init__.py", "__main__.py", "cli.py", "cli_parser.py", "config.py", "model.py",
    "host/__init__.py", "host/atomic.py", "host/notify.py", "host/pdeathsig.py", "host/procfs.py", "host/untrusted.py",
    "cudacore/__init__.py", "cudacore/cubin.py", "cudacore/demangle.py", "cudacore/driverlog.py", "cudacore/elf.py",
    "fleet/__init__.py", "fleet/url.py",
    "workload/__init__.py", "workload/beat_segment.py", "workload/client.py", "workload/dump_names.py",
    "workload/ended.py", "workload/exits.py", "workload/launcher.py", "workload/registration_file.py",
    "workload/runtime_files.py",
    "workload/introspect/__init__.py", "workload/introspect/graph_replays.py", "workload/introspect/imports.py",
    "workload/introspect/loops.py", "workload/introspect/objects.py",
    "workload/introspect/pools.py", "workload/introspect/report.py", "workload/introspect/reporter.py",
    "workload/introspect/source.py", "workload/introspect/sync.py", "workload/introspect/tasks_ended.py",
    "workload/introspect/threads.py",
    "workload/introspect/waits.py",
    "workload/introspect/bootstrap/__init__.py", "workload/introspect/bootstrap/sitecustomize.py",
)

MAIN = b"import sys\n\nfrom hangwatchd.cli import main\n\nsys.exit(main())\n"
# A fixed time for every member: the same source makes the same bytes (an image layer that caches).
EPOCH = (1980, 1, 1, 0, 0, 0)


def package_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def build(out: Path) -> Path:
    """Write the bundle to ``out`` (a file, or a directory to put NAME in); return its path."""
    out = out / NAME if out.is_dir() else out
    root = package_dir()
    buf = io.BytesIO()
    buf.write(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for rel in JOB_SIDE:
            _add(z, f"hangwatchd/{rel}", (root / rel).read_bytes())
        _add(z, "__main__.py", MAIN)
    write_atomic(out, buf.getvalue(), mode=0o755)
    os.chmod(out, 0o755)  # whatever the umask took off
    return out


def _add(z: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=EPOCH)
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, data)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m hangwatchd.workload.bundle OUT   (a file, or a directory for "
              f"{NAME})", file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    print(build(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
