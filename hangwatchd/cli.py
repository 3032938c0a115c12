"""The ``hangwatchd`` command: parses arguments, calls the stage that does the work, prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from .cudacore.errors import CoreDumpError


class UsageError(Exception):
    """Bad usage or input: exit status 2 with one line."""


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def cmd_symbolize(args: argparse.Namespace) -> int:
    from .cudacore.cudagdb import cross_check
    from .cudacore.symbolize import symbolize
    from .report.gpu import render

    result = symbolize(args.dump)
    if args.cuda_gdb:
        result = dataclasses.replace(result, cuda_gdb=cross_check(args.dump))
    if args.json:
        _print_json(result.to_dict())
    else:
        sys.stdout.write(render(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hangwatchd", description="Watchdog for hung GPU jobs.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("symbolize", help="explain a CUDA coredump: kernels, warps, exceptions, inline chains")
    s.add_argument("dump", help="the coredump (raw, or compressed .xz/.gz/.zst)")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.add_argument("--cuda-gdb", action="store_true", help="also run cuda-gdb, where installed, and show its answer")
    s.set_defaults(func=cmd_symbolize)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CoreDumpError, UsageError) as exc:
        print(f"hangwatchd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
