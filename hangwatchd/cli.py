"""The ``hangwatchd`` command: parses arguments, calls the stage that does the work, prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .config import ConfigError, client_runtime_dir
from .cudacore.errors import CoreDumpError
from .metrics import AddressError
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
        "store": args.store, "node_name": args.node_name,
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
    from .report import html
    from .store import Store, StoreError

    cfg = config.load(args.config, {"state_dir": args.state_dir, "runtime_dir": args.runtime_dir})
    log.configure("console", "warning")
    target = registry.from_proc(args.pid)
    if target is None:
        raise UsageError(f"capture: no process {args.pid}")
    store = Store(cfg.state_dir, pages=html.pages)
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
    from .analyze.verdict import analyze, process_dirs
    from .report.incident import render_analysis

    if args.store:
        return _analyze_store(args)
    if not args.dir:
        raise UsageError("analyze: give an incident directory, or --store URL --job JOB")
    path = Path(args.dir)
    if not path.is_dir():
        raise UsageError(f"analyze: {path} is not a directory; give an incident directory (one subdirectory per process)")
    if not (path / "incident.json").exists() and not process_dirs(path):
        raise UsageError(f"analyze: {path} is no incident: it has no incident.json and no process subdirectory "
                         "with proc.json, pyspy.json, symbolized.json, ...; give an incident directory")
    result = analyze(path)
    if args.json:
        _print_json(result.to_dict())
    else:
        sys.stdout.write(render_analysis(result.to_dict()))
    return 0


def _store_url(args: argparse.Namespace) -> Any:
    from .fleet.url import StoreURLError, parse

    try:
        return parse(args.store)
    except StoreURLError as exc:
        raise UsageError(str(exc)) from None


def _analyze_store(args: argparse.Namespace) -> int:
    """The newest incident of a job from every node, merged into one directory and analysed as one."""
    import tempfile

    from .analyze.verdict import analyze
    from .fleet.reader import ReadError, fetch, job_incidents
    from .report.incident import render_analysis

    if not args.job:
        raise UsageError("analyze --store: give the job with --job JOB ('hangwatchd incidents --store URL' lists them)")
    url = _store_url(args)
    try:
        found = job_incidents(url, args.job)
        if not found:
            raise Failure(f"no incident of job {args.job!r} in {url}")
        with tempfile.TemporaryDirectory(prefix="hangwatchd-job-") as tmp:
            merged = fetch(url, found[0], Path(tmp) / found[0].job_incident)
            job = {k: v for k, v in found[0].to_dict().items() if k != "ranks"}  # the analysis's ranks say more
            result = {**analyze(merged).to_dict(), **job}
    except ReadError as exc:
        raise Failure(str(exc)) from None
    if args.json:
        _print_json(result)
    else:
        sys.stdout.write(f"job {result['job']}, job incident {result['job_incident']}, nodes {', '.join(result['nodes'])}\n")
        sys.stdout.write(render_analysis(result))
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
            str(p["pid"]), _cut(p.get("job") or "-", 32),
            "launcher" if p.get("role") == "launcher" else str(p["rank"]) if p.get("rank") is not None else "-", p["state"],
            f"{age:.1f}s ago" if age is not None else "never",
            f"{p['timeout']:.3g}s ({p.get('timeout_source', 'config')})", p.get("incident") or "-",
            _cut(" ".join(p.get("cmdline") or []), 60),
        ))
    _table(rows)
    if len(rows) == 1:
        print("(no process is watched)")
    return 0


def _cut(text: str, width: int) -> str:
    """At most ``width`` characters; a cut one ends in '…' so nobody reads '3' for '30'."""
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


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


def _store_incidents(args: argparse.Namespace) -> int:
    from .fleet.reader import ReadError, job_incidents

    url = _store_url(args)
    try:
        items = [j.to_dict() for j in job_incidents(url, args.job)]
    except ReadError as exc:
        raise Failure(str(exc)) from None
    if args.json:
        _print_json(items)
        return 0
    if not items:
        print(f"no job incidents in {url}" + (f" for job {args.job}" if args.job else ""))
        return 0
    rows = [("JOB INCIDENT", "TIME (UTC)", "JOB", "NODES", "RANKS", "REASON")]
    for i in items:
        rows.append((i["job_incident"], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(i["time"])), i["job"],
                     ",".join(i["nodes"]), ",".join(map(str, i["ranks"])) or "-", i["reason"] or "-"))
    _table(rows)
    return 0
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
    from .report.names import fold

    if args.store:
        return _store_incidents(args)
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
                     time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(i["time"])), i["reason"], _cut(i["job"] or "-", 32),
                     _cut(",".join(map(str, i["processes"])), 24), _cut(fold(i["summary"] or ""), 100)))
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
#
# Every subcommand is declared through ``_command``: a one-line summary (the
# top-level list), a description and an example (its own --help). Defaults are
# written into each flag's help from config.KEYS, so --help cannot drift from
# the daemon.

class _Parser(argparse.ArgumentParser):
    """Bad usage is one line on stderr and exit status 2, like every other error here."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see '{self.prog} --help'\n")


class _Formatter(argparse.HelpFormatter):
    """Wraps prose, keeps the example lines (indented) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(line if not line or line.startswith("  ") else
                         textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         for line in text.splitlines())


def _default(key: str) -> str:
    from .config import KEYS

    value = KEYS[key].default
    return '""' if value == "" else str(value)


def _command(sub: Any, name: str, func: Any, summary: str, description: str, examples: Sequence[str],
             parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    p = sub.add_parser(name, parents=list(parents), help=summary, description=description, epilog=epilog,
                       formatter_class=_Formatter)
    p.set_defaults(func=func)
    return p


def _duration(text: str) -> float:
    """argparse type for a duration flag: 30, 2.5, "500ms", "10m"."""
    from .config import Invalid, parse_duration

    try:
        return parse_duration(float(text) if _is_number(text) else text)
    except Invalid as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {exc}") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(
        prog="hangwatchd", formatter_class=_Formatter,
        description="Watchdog for hung GPU jobs: notices a process that stopped making progress, captures its "
                    "stacks and GPU state before anyone kills it, explains the hang, stores an incident and "
                    "exports Prometheus metrics.",
        epilog="examples:\n  hangwatchd daemon --config /etc/hangwatchd/hangwatchd.toml\n"
               "  hangwatchd run --job train -- torchrun --nproc-per-node 8 train.py\n"
               "  hangwatchd incidents\n\n'hangwatchd COMMAND --help' describes each command.")
    p.add_argument("--version", action="version", version=f"hangwatchd {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Options several commands share, defined once.
    dirs = argparse.ArgumentParser(add_help=False)
    dirs.add_argument("--state-dir", help="incidents and their index (default: the running daemon's, "
                                          f"else {_default('state_dir')})")
    dirs.add_argument("--runtime-dir", help="the daemon's runtime dir, where it says what it watches "
                                            f"(default: $HANGWATCHD_RUNTIME_DIR, else {_default('runtime_dir')})")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON instead of text")
    config_file = argparse.ArgumentParser(add_help=False)
    config_file.add_argument("--config", metavar="FILE", help="TOML config file, every key optional; see "
                             "config/hangwatchd.toml (default: none, the built-in defaults)")

    d = _command(sub, "daemon", cmd_daemon, "run the watchdog in the foreground (a systemd Type=notify service)",
                 "Watch every registered (and, with discover = true, every GPU) process; declare a hang when its "
                 "heartbeat or its stack stops; capture, explain and store an incident; serve /metrics. "
                 "Flags override the config file. Runs until SIGTERM.",
                 ["hangwatchd daemon --config /etc/hangwatchd/hangwatchd.toml",
                  "hangwatchd daemon --state-dir /tmp/hw --runtime-dir /tmp/hw-run --log-format console"],
                 [config_file])
    d.add_argument("--state-dir", help=f"incidents and their index (default: {_default('state_dir')})")
    d.add_argument("--runtime-dir", help="registrations, heartbeat segments, pipes; workloads find it through "
                                         f"$HANGWATCHD_RUNTIME_DIR (default: {_default('runtime_dir')})")
    d.add_argument("--dump-dir", help="where CUDA writes coredumps (default: STATE_DIR/dumps)")
    d.add_argument("--metrics-address", metavar="HOST:PORT",
                   help=f"where Prometheus scrapes /metrics; port 0 picks one, '' serves none (default: {_default('metrics_address')})")
    d.add_argument("--heartbeat-timeout", type=_duration, metavar="DURATION",
                   help="time without a beat before a process that declared no timeout is hung: seconds, or "
                        f"with a unit (500ms, 10m) (default: {_default('heartbeat_timeout')} s)")
    d.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="shared store for job incidents across nodes; endpoint and credentials from the AWS_* "
                        "variables or a role (default: none)")
    d.add_argument("--node-name", metavar="NAME", help="this node's name in the store, records and metrics (default: the host name)")
    d.add_argument("--log-format", choices=["json", "console"],
                   help=f"json: one JSON object a line, for a log shipper; console: for a person (default: {_default('log_format')})")
    d.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help=f"the least severe events logged (default: {_default('log_level')})")

    r = _command(sub, "run", cmd_run, "run a workload watched: hangwatchd run [options] -- CMD ...",
                 "Start CMD with the CUDA coredump and PyTorch flight-recorder variables set (they only work when "
                 "set before CUDA starts) and register it with the daemon. CMD's exit status is this command's.",
                 ["hangwatchd run --heartbeat-timeout 5m -- python train.py",
                  "hangwatchd run --job llama --stack-timeout 10m -- torchrun --nproc-per-node 8 train.py"])
    r.add_argument("--job", help="job id, to group ranks (default: $TORCHELASTIC_RUN_ID, else $MASTER_ADDR:$MASTER_PORT)")
    r.add_argument("--rank", type=int, help="this process's rank (default: $RANK)")
    r.add_argument("--heartbeat-timeout", type=_duration, metavar="DURATION",
                   help="time without hangwatchd.beat() (or sd_notify WATCHDOG=1) before it is hung: seconds, or "
                        "with a unit (500ms, 10m) (default: learned from its beats, else the daemon's heartbeat_timeout)")
    r.add_argument("--stack-timeout", type=_duration, metavar="DURATION",
                   help="time its Python stack may stay the same, for workloads that never beat "
                        "(default: none, not watched by its stack unless the daemon's config says so)")
    r.add_argument("--runtime-dir", help="the daemon's runtime dir (default: $HANGWATCHD_RUNTIME_DIR, "
                                         f"else {_default('runtime_dir')})")
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the workload and its arguments")

    _command(sub, "status", cmd_status, "every watched process: job, rank, state, last beat, timeout",
             "Ask the running daemon (through its runtime dir) what it watches: each process's job, rank, state, "
             "last beat, timeout (and where it came from) and incident.",
             ["hangwatchd status", "hangwatchd status --json | jq '.processes[] | select(.state != \"healthy\")'"],
             [dirs, as_json])

    i = _command(sub, "incidents", cmd_incidents, "stored incidents, newest first",
                 "List the incidents in the state dir, newest first: id, time, reason, job, pids and a one-line summary. "
                 "With --store, list the job incidents of a shared store across nodes.",
                 ["hangwatchd incidents", "hangwatchd incidents --state-dir /var/lib/hangwatchd --json",
                  "hangwatchd incidents --store s3://hangwatchd-incidents/prod --job llama"],
                 [dirs, as_json])
    i.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="list job incidents across nodes from this shared store (default: this node's state dir)")
    i.add_argument("--job", help="only this job's incidents, with --store (default: every job)")

    sh = _command(sub, "show", cmd_show, "the report of one incident",
                  "Print one incident: the verdict, each process's capture steps and stacks, the analysis across "
                  "ranks. Each stored incident also holds this page as report.html.",
                  ["hangwatchd show 20261129T192301Z-854e77", "hangwatchd show 20261129T19 --html report.html"],
                  [dirs, as_json])
    sh.add_argument("id", metavar="ID", help="incident id, as 'hangwatchd incidents' lists it (a unique prefix will do)")
    sh.add_argument("--html", nargs="?", const="", metavar="FILE",
                    help="write one self-contained HTML page and print its path (default FILE: ./hangwatchd-ID.html)")

    c = _command(sub, "capture", cmd_capture, "capture a process's evidence now, into a new incident",
                 "Run the capture steps on PID by hand, as the daemon does on a hang, and store an incident. "
                 "Without --gpu-dump the process keeps running.",
                 ["hangwatchd capture 4174", "hangwatchd capture --gpu-dump 4174"],
                 [dirs, as_json, config_file])
    c.add_argument("pid", type=int, metavar="PID", help="the process to capture (yours, or any as root)")
    c.add_argument("--gpu-dump", action="store_true", help="also take a CUDA coredump (this ends the process)")

    an = _command(sub, "analyze", cmd_analyze, "explain an incident directory: each rank's verdict, the rank that diverged",
                  "Read an incident directory (one subdirectory per process: pyspy.json, flight-recorder.pkl, "
                  "symbolized.json, ...) and say what each rank was doing and which one diverged. With --store and "
                  "--job, fetch the job's newest incident from every node and explain it as one.",
                  ["hangwatchd analyze /var/lib/hangwatchd/incidents/20261129T192301Z-854e77",
                   "hangwatchd analyze ./by-hand --json",
                   "hangwatchd analyze --store s3://hangwatchd-incidents/prod --job llama --json"],
                  [as_json])
    an.add_argument("dir", metavar="DIR", nargs="?", help="an incident directory (also one put together by hand)")
    an.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="analyse a job across nodes from this shared store, with --job (default: none, read DIR)")
    an.add_argument("--job", help="the job whose newest incident to fetch from every node, with --store (default: none)")

    ck = _command(sub, "check", cmd_check, "can this node do the job? ptrace, py-spy, nvdisasm, NVML, dirs, port, inotify",
                  "Check what the daemon needs on this node and say how to fix what is missing. "
                  "Exit status 1 when a required check fails.",
                  ["hangwatchd check", "hangwatchd check --config /etc/hangwatchd/hangwatchd.toml --json"],
                  [dirs, as_json, config_file])
    ck.add_argument("--dump-dir", help="where CUDA writes coredumps (default: STATE_DIR/dumps)")
    ck.add_argument("--metrics-address", metavar="HOST:PORT",
                    help=f"the address to check is free (default: {_default('metrics_address')})")

    s = _command(sub, "symbolize", cmd_symbolize, "explain a CUDA coredump: kernels, warps, exceptions, inline chains",
                 "Read a CUDA coredump (.nvcudmp) in pure Python: every kernel, every warp's PC grouped, each "
                 "exception with its source line and whole inline chain.",
                 ["hangwatchd symbolize core_node7.4174.nvcudmp", "hangwatchd symbolize --json dump.nvcudmp.zst | jq .exceptions"],
                 [as_json])
    s.add_argument("dump", metavar="DUMP", help="the coredump (raw, or compressed .xz/.gz/.zst)")
    s.add_argument("--cuda-gdb", action="store_true", help="also run cuda-gdb, where installed, and show its answer")
    s.add_argument("--chains", choices=["line-table", "nvdisasm"], default="line-table",
                   help="where inline chains come from: the cubins' line tables (fast) or nvdisasm -gi (default: line-table)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CoreDumpError, UsageError, ConfigError, AddressError) as exc:
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
