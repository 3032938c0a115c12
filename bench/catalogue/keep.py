"""Keep the incidents a catalogue run stored, as test fixtures: one folder per class, in one tarball.

    python -m bench.catalogue --workdir /tmp/cw
    python -m bench.catalogue.keep /tmp/cw tests/fixtures/incidents/catalogue-cpu.tar.xz

Each incident goes in as ``CASE/`` (its job is ``cat-CASE-TAG``), without its HTML page; the
tarball is written the same way every time (sorted, no owners, no times) so that a new run's
changes are the evidence's own. ``tests/test_recorded_catalogue.py`` reads it back. A class
recorded again where it hangs otherwise (another interpreter, another race) goes in beside it
as ``CASE@VARIANT/``: ``write`` takes whatever names it is given.
"""

from __future__ import annotations

import io
import json
import re
import sys
import tarfile
from pathlib import Path

JOB = re.compile(r"^cat-(?P<case>[a-z0-9_]+)-[0-9a-f]{6}$")


def incidents(workdir: Path) -> dict[str, Path]:
    """Each class's incident folder (its first, where a class stored more than one)."""
    found: dict[str, Path] = {}
    for d in sorted((workdir / "daemon" / "state" / "incidents").iterdir()):
        try:
            job = json.loads((d / "incident.json").read_text()).get("job") or ""
        except (OSError, ValueError):
            continue
        m = JOB.match(job)
        if m and m["case"] not in found:
            found[m["case"]] = d
    return found


def write(found: dict[str, Path], out: Path) -> None:
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for case, d in sorted(found.items()):
            for f in sorted(p for p in d.rglob("*") if p.is_file() and p.name != "report.html"):
                data = f.read_bytes()
                info = tarfile.TarInfo(f"{case}/{f.relative_to(d)}")
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bench.catalogue.keep WORKDIR OUT.tar.xz", file=sys.stderr)
        return 2
    found = incidents(Path(argv[0]))
    if not found:
        print(f"catalogue.keep: no catalogue incident under {argv[0]}/daemon/state/incidents", file=sys.stderr)
        return 2
    write(found, Path(argv[1]))
    print(f"catalogue.keep: {len(found)} incidents into {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
