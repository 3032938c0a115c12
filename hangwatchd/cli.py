"""The ``hangwatchd`` command: parses arguments, calls the stage that does the work, prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import ConfigError, client_runtime_dir
from .cudacore.errors import CoreDumpError
from .store import StoreError


class UsageError(Exception):
    """Bad usage or input: exit status 2 with one line."""


class Failure(Exception):
    """The command could not do its job: exit status 1 with one line."""


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


# -- symbolize -------------------------------------------------------------

def cmd_symbolize(args: argparse.Namespace) -> int:
    from .cudacore.cudagdb import cross_check
    from .cudacore.symbolize import symbolize
    from .report.gpu import render

    result = symbolize(args.dump, chains=args.chains)
    if args.cuda_gdb:
        result = dataclasses.replace(result, cuda_gdb=cross_check(args.dump))
    if args.json:
        _print_json(result.to_dict())
    else:
        sys.stdout.write(render(result))
    return 0


# -- daemon ----------------------------------------------------------------

def _daemon_config(args: argparse.Namespace) -> Any:
    from . import config

    overrides = {
        "state_dir": args.state_dir, "runtime_dir": args.runtime_dir, "dump_dir": args.dump_dir,
        "metrics_address": args.metrics_address, "heartbeat_timeout": args.heartbeat_timeout,
        "log_format": args.log_format, "log_level": args.log_level,
    }
    return config.load(args.config, overrides)


def cmd_daemon(args: argparse.Namespace) -> int:
    from . import log
    from .daemon import Daemon, SetupError
    from .store import StoreError

    cfg = _daemon_config(args)
    log.configure(cfg.log_format, cfg.log_level)
    try:
        return Daemon(cfg).run()
    except (StoreError, SetupError) as exc:
        raise UsageError(str(exc)) from None


# -- run -------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    from .launcher import Launch, LaunchError, run

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("run: no command given; usage: hangwatchd run [options] -- CMD [ARGS...]")
    for flag, value in (("--heartbeat-timeout", args.heartbeat_timeout), ("--stack-timeout", args.stack_timeout)):
        if value is not None and value <= 0:
            raise UsageError(f"run: {flag} must be a number of seconds greater than 0")
    runtime_dir = Path(args.runtime_dir) if args.runtime_dir else client_runtime_dir()
    try:
        return run(Launch(tuple(command), runtime_dir, args.job, args.rank, args.heartbeat_timeout, args.stack_timeout))
    except LaunchError as exc:
        print(f"hangwatchd: {exc}", file=sys.stderr)
        return 127


# -- capture by hand -------------------------------------------------------

def cmd_capture(args: argparse.Namespace) -> int:
    from . import config, log, registry
    from .capture import capture_incident, make_steps
    from .model import Suspicion
    from .store import Store, StoreError

    cfg = config.load(args.config, {"state_dir": args.state_dir, "runtime_dir": args.runtime_dir})
    log.configure("console", "warning")
    target = registry.from_proc(args.pid)
    if target is None:
        raise UsageError(f"capture: no process {args.pid}")
    store = Store(cfg.state_dir)
    try:
        store.open()
    except StoreError as exc:
        raise UsageError(str(exc)) from None

    def gate(_outdir: Path) -> str | None:
        return None if args.gpu_dump else "not asked for (hangwatchd capture --gpu-dump)"

    why = Suspicion("manual", "captured by hand with hangwatchd capture" + (" --gpu-dump" if args.gpu_dump else ""), time.time())
    incident_id = capture_incident(store, make_steps(cfg), [target], why, cfg.capture_timeout, gate=gate)
    path = store.path_of(incident_id)
    assert path is not None
    return _print_incident(args, path)


# -- analyze ---------------------------------------------------------------

def cmd_analyze(args: argparse.Namespace) -> int:
    from .analyze.verdict import analyze
    from .report.incident import render_analysis

    path = Path(args.dir)
    if not path.is_dir():
        raise UsageError(f"analyze: {path} is not a directory; give an incident directory (one subdirectory per process)")
    result = analyze(path)
    if args.json:
        _print_json(result.to_dict())
    else:
        sys.stdout.write(render_analysis(result.to_dict()))
    return 0


# -- check -----------------------------------------------------------------

def cmd_check(args: argparse.Namespace) -> int:
    from . import check, config

    cfg = config.load(args.config, {"state_dir": args.state_dir, "runtime_dir": args.runtime_dir,
                                    "dump_dir": args.dump_dir, "metrics_address": args.metrics_address})
    checks = check.run_checks(cfg)
    if args.json:
        _print_json([dataclasses.asdict(c) for c in checks])
    else:
        sys.stdout.write(check.render(checks))
    return 0 if all(c.ok or not c.required for c in checks) else 1


def _print_incident(args: argparse.Namespace, path: Path) -> int:
    """An incident for a person (text), a script (--json) or a ticket (--html)."""
    from .report import incident

    data = incident.load(path)
    if getattr(args, "html", None) is not None:
        from .report import html

        out = Path(args.html or f"hangwatchd-{data.get('id') or path.name}.html")
        try:
            out.write_text(html.render(data, path))
        except OSError as exc:
            raise UsageError(f"show: cannot write {out} ({exc.strerror}); pass --html FILE somewhere writable") from None
        print(out)
    elif args.json:
        _print_json(data)
    else:
        sys.stdout.write(incident.render_text(data))
    return 0


# -- status, incidents, show ----------------------------------------------

def cmd_status(args: argparse.Namespace) -> int:
    from . import heartbeat, runtime

    runtime_dir = Path(args.runtime_dir) if args.runtime_dir else client_runtime_dir()
    status = runtime.status(runtime_dir)
    if status is None:
        raise Failure(f"no daemon is running with runtime dir {runtime_dir}; start one with 'hangwatchd daemon'")
    for p in status["processes"]:
        if p.get("beat_file"):  # fresher than the daemon's last write
            try:
                reading = heartbeat.read(p["beat_file"])
                p["last_beat_age"] = reading.age()
                p["beats"] = reading.count
            except heartbeat.SegmentError:
                pass
    if args.json:
        _print_json(status)
        return 0
    d = status["daemon"]
    print(f"hangwatchd {d.get('version')} pid {d.get('pid')}, metrics on {d.get('metrics_address') or 'none'}, "
          f"state dir {d.get('state_dir')}")
    rows = [("PID", "JOB", "RANK", "STATE", "LAST BEAT", "TIMEOUT", "INCIDENT", "COMMAND")]
    for p in status["processes"]:
        age = p.get("last_beat_age")
        rows.append((
            str(p["pid"]), p.get("job") or "-", str(p["rank"]) if p.get("rank") is not None else "-", p["state"],
            f"{age:.1f}s ago" if age is not None else "never",
            f"{p['timeout']:.3g}s ({p.get('timeout_source', 'config')})", p.get("incident") or "-",
            " ".join(p.get("cmdline") or [])[:60],
        ))
    _table(rows)
    if len(rows) == 1:
        print("(no process is watched)")
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _store(args: argparse.Namespace) -> Any:
    from . import config, runtime
    from .store import Store

    state_dir = args.state_dir
    if not state_dir:
        info = runtime.daemon_info(Path(args.runtime_dir) if getattr(args, "runtime_dir", None) else client_runtime_dir())
        state_dir = info["state_dir"] if info else config.Config().state_dir
    return Store(state_dir)


def _list(store: Any) -> list[dict[str, Any]]:
    from .store import StoreError

    try:
        return store.list()  # type: ignore[no-any-return]
    except StoreError as exc:  # a full or broken disk: one line, not a traceback
        raise Failure(str(exc)) from None


def _pending(args: argparse.Namespace) -> Any:
    """The daemon's spool of reports waiting for room in the state dir."""
    from .spool import SPOOL_DIR, Spool

    return Spool((Path(args.runtime_dir) if getattr(args, "runtime_dir", None) else client_runtime_dir()) / SPOOL_DIR)


def cmd_incidents(args: argparse.Namespace) -> int:
    store = _store(args)
    items = _list(store)
    waiting = _pending(args).pending()
    note = (f"{len(waiting)} incidents wait for room in {store.root} (kept in {waiting[0].parent}); "
            "they are listed once it has room") if waiting else ""
    if note and not items and not args.json:
        print(f"no incidents stored in {store.root}; {note}")
        return 0
    if note:  # on stderr: --json and the table stay what they are
        print(f"hangwatchd: {note}", file=sys.stderr)
    if args.json:
        _print_json(items)
        return 0
    if not items:
        print(f"no incidents in {store.root}")
        return 0
    rows = [("ID", "TIME (UTC)", "REASON", "JOB", "PIDS", "SUMMARY")]
    for i in items:
        rows.append((i["id"] + ("" if i["complete"] else " (incomplete)"),
                     time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(i["time"])), i["reason"], i["job"] or "-",
                     ",".join(map(str, i["processes"])), (i["summary"] or "")[:80]))
    _table(rows)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    _list(store)  # an unreadable index says so in one line
    path = store.path_of(args.id)
    if path is None and _pending(args).find(args.id):
        raise Failure(f"incident {args.id} waits for room in the state dir {store.root} (its report is kept in "
                      f"{_pending(args).find(args.id)}); it is stored, and shown here, once the disk has room")
    if path is None:
        raise UsageError(f"no incident '{args.id}' in {store.root}; 'hangwatchd incidents' lists them")
    return _print_incident(args, path)


# -- the parser ------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hangwatchd", description="Watchdog for hung GPU jobs.")
    sub = p.add_subparsers(dest="command", required=True)
    # Options several commands share, defined once.
    dirs = argparse.ArgumentParser(add_help=False)
    dirs.add_argument("--state-dir", help="incidents and their index (default: the running daemon's, else /var/lib/hangwatchd)")
    dirs.add_argument("--runtime-dir", help="the daemon's runtime dir (default $HANGWATCHD_RUNTIME_DIR or /run/hangwatchd)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON instead of text")

    d = sub.add_parser("daemon", help="run the watchdog in the foreground (a systemd Type=notify service)")
    d.add_argument("--config", help="TOML config file (see config/hangwatchd.toml)")
    d.add_argument("--state-dir", help="incidents and their index (default /var/lib/hangwatchd)")
    d.add_argument("--runtime-dir", help="registrations, heartbeat segments, pipes (default /run/hangwatchd)")
    d.add_argument("--dump-dir", help="where CUDA writes coredumps (default STATE_DIR/dumps)")
    d.add_argument("--metrics-address", help="HOST:PORT for Prometheus /metrics; '' for none (default 0.0.0.0:9842)")
    d.add_argument("--heartbeat-timeout", type=float, help="seconds without a beat before a process is hung")
    d.add_argument("--log-format", choices=["json", "console"])
    d.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    d.set_defaults(func=cmd_daemon)

    r = sub.add_parser("run", help="run a workload watched: hangwatchd run [options] -- CMD ...")
    r.add_argument("--job", help="job id (default: $TORCHELASTIC_RUN_ID, or $MASTER_ADDR:$MASTER_PORT)")
    r.add_argument("--rank", type=int, help="rank (default: $RANK)")
    r.add_argument("--heartbeat-timeout", type=float, help="seconds without hangwatchd.beat() (or sd_notify WATCHDOG=1) "
                   "before it is hung (default: learned from its beats)")
    r.add_argument("--stack-timeout", type=float, help="seconds its Python stack may stay the same: it must keep moving")
    r.add_argument("--runtime-dir", help="the daemon's runtime dir (default $HANGWATCHD_RUNTIME_DIR or /run/hangwatchd)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    r.set_defaults(func=cmd_run)

    st = sub.add_parser("status", parents=[dirs, as_json], help="every watched process: job, rank, state, last beat, timeout")
    st.set_defaults(func=cmd_status)

    i = sub.add_parser("incidents", parents=[dirs, as_json], help="stored incidents, newest first")
    i.set_defaults(func=cmd_incidents)

    sh = sub.add_parser("show", parents=[dirs, as_json], help="the report of one incident")
    sh.add_argument("id", help="incident id (a unique prefix will do)")
    sh.add_argument("--html", nargs="?", const="", metavar="FILE",
                    help="write one self-contained HTML page (default ./hangwatchd-ID.html) and print its path")
    sh.set_defaults(func=cmd_show)

    c = sub.add_parser("capture", parents=[dirs, as_json], help="capture a process's evidence now, into a new incident")
    c.add_argument("pid", type=int)
    c.add_argument("--gpu-dump", action="store_true", help="also take a CUDA coredump (this ends the process)")
    c.add_argument("--config")
    c.set_defaults(func=cmd_capture)

    an = sub.add_parser("analyze", parents=[as_json],
                        help="explain an incident directory: each rank's verdict, the rank that diverged")
    an.add_argument("dir", help="an incident directory (also one put together by hand)")
    an.set_defaults(func=cmd_analyze)

    ck = sub.add_parser("check", parents=[dirs, as_json],
                        help="can this node do the job? ptrace, py-spy, nvdisasm, NVML, dirs, port, inotify")
    ck.add_argument("--config")
    ck.add_argument("--dump-dir")
    ck.add_argument("--metrics-address")
    ck.set_defaults(func=cmd_check)

    s = sub.add_parser("symbolize", parents=[as_json], help="explain a CUDA coredump: kernels, warps, exceptions, inline chains")
    s.add_argument("dump", help="the coredump (raw, or compressed .xz/.gz/.zst)")
    s.add_argument("--cuda-gdb", action="store_true", help="also run cuda-gdb, where installed, and show its answer")
    s.add_argument("--chains", choices=["line-table", "nvdisasm"], default="line-table",
                   help="where inline chains come from: the cubins' line tables (default, fast) or nvdisasm -gi")
    s.set_defaults(func=cmd_symbolize)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CoreDumpError, UsageError, ConfigError) as exc:
        print(f"hangwatchd: {exc}", file=sys.stderr)
        return 2
    except (Failure, StoreError) as exc:
        print(f"hangwatchd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
