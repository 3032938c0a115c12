"""The ``hangwatchd`` command: parses arguments, calls the stage that does the work, prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cli_parser import DEFAULT_LIMIT, build_parser, show_target

# What each kind of user error is, by the module that raises it: looked up only in modules
# a command has imported (one that was never imported raised nothing), so that no command
# pays for the others' imports (`symbolize` must not load structlog, prometheus_client or the store).
USAGE_ERRORS = (("hangwatchd.cudacore.errors", "CoreDumpError"), ("hangwatchd.config", "ConfigError"),
                ("hangwatchd.metrics", "AddressError"))
FAILURES = (("hangwatchd.incidents.index", "StoreError"), ("hangwatchd.incidents.ledger", "LedgerError"))
SPOOL = ("spool", ".row.json")  # the daemon's spool dir and its rows (incidents.spool), looked at before importing it


def _loaded(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    return tuple(getattr(sys.modules[m], n) for m, n in names if m in sys.modules)


# config's, named here without importing it (its settings cost `hangwatchd incidents` a third
# of its run); tests/test_cli.py holds them equal.
RUNTIME_DIR_ENV, DEFAULT_RUNTIME_DIR = "HANGWATCHD_RUNTIME_DIR", "/run/hangwatchd"


def client_runtime_dir() -> Path:
    """Where the running daemon's runtime dir is, as a workload finds it (config.client_runtime_dir)."""
    return Path(os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)


class UsageError(Exception):
    """Bad usage or input: exit status 2 with one line."""


class Failure(Exception):
    """The command could not do its job: exit status 1 with one line."""


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


# -- symbolize -------------------------------------------------------------

def cmd_symbolize(args: argparse.Namespace) -> int:
    import dataclasses

    from .cudacore.symbolize import symbolize

    result = symbolize(args.dump, chains=args.chains)
    if args.cuda_gdb:
        from .cudacore.cudagdb import cross_check

        result = dataclasses.replace(result, cuda_gdb=cross_check(args.dump))
    if args.json:
        _print_json(result.to_dict())
    else:
        from .report.gpu import render

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
    from .daemon.loop import Daemon, SetupError
    from .incidents.store import StoreError

    cfg = _daemon_config(args)
    log.configure(cfg.log_format, cfg.log_level)
    _open_files_up_to_hard_limit()
    try:
        return Daemon(cfg).run()
    except (StoreError, SetupError) as exc:
        raise UsageError(str(exc)) from None


def _open_files_up_to_hard_limit() -> None:
    """The soft limit on open files raised to the hard one, as systemd asks of a program that needs
    many (its default soft limit, 1024, is for programs that still use select()): every watched process
    holds descriptors of the daemon's (its exception FIFO's two ends and a pidfd), and one user's
    programs below their workloads alone may hold 900; at 1024 the daemon could open nothing else."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # unlimited: the kernel's default fs.nr_open
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # past fs.nr_open: the soft limit stays as it was


# -- run -------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    from .workload.launcher import Launch, LaunchError, run

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
        return run(Launch(tuple(command), runtime_dir, args.job, args.rank, args.heartbeat_timeout, args.stack_timeout,
                          args.on_hang, args.introspect))
    except LaunchError as exc:
        print(f"hangwatchd: {exc}", file=sys.stderr)
        return 127


# -- capture by hand -------------------------------------------------------

def cmd_capture(args: argparse.Namespace) -> int:
    from . import config, log
    from .capture import capture_budget, make_steps
    from .daemon.make_incident import make_incident
    from .host.deadline import Deadline
    from .incidents.store import Store, StoreError
    from .model import Suspicion
    from .workload import registration_file

    cfg = config.load(args.config, _daemon_dirs(args)[0])  # the running daemon's dirs, as status finds them
    log.configure("console", "warning")
    target = registration_file.from_proc(args.pid)
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
    incident_id = make_incident(store, make_steps(cfg), [target], why, Deadline.after(capture_budget(cfg)), gate=gate)
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
    result = analyze(path, raw_dumps=_symbolize_limits())
    if args.json:
        _print_json(result.to_dict())
    else:
        sys.stdout.write(render_analysis(result.to_dict()))
    return 0


def _symbolize_limits() -> Any:
    """The limits a raw GPU dump in a directory is symbolised under (an untrusted dump, as in the
    daemon: the config's defaults), in the sandbox's child."""
    from .config import Config
    from .cudacore import sandbox

    cfg = Config()
    return sandbox.Limits(cfg.symbolize_cpu_seconds, int(cfg.symbolize_memory_mb), cfg.symbolize_timeout)


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
    from . import log

    log.configure("console", "warning")  # a store part refused is said on stderr; stdout stays the answer
    url = _store_url(args)
    try:
        found = job_incidents(url, args.job)
        pace = _store_pace(url, args.job)
        if not found and pace is None:
            raise Failure(f"no incident of job {args.job!r} and no record of its pace in {url}")
        result: dict[str, Any] = {}
        if found:
            with tempfile.TemporaryDirectory(prefix="hangwatchd-job-") as tmp:
                merged = fetch(url, found[0], Path(tmp) / found[0].job_incident)
                job = {k: v for k, v in found[0].to_dict().items() if k != "ranks"}  # the analysis's ranks say more
                result = {**analyze(merged, raw_dumps=_symbolize_limits()).to_dict(), **job}
        if pace is not None:
            result["pace"] = pace
    except ReadError as exc:
        raise Failure(str(exc)) from None
    if args.json:
        _print_json(result)
        return 0
    from .report.terminal import escape  # names from the store: any node wrote them

    if found:
        sys.stdout.write(escape(f"job {result['job']}, job incident {result['job_incident']}, nodes {', '.join(result['nodes'])}") + "\n")
        sys.stdout.write(render_analysis(result))
    if pace is not None:
        sys.stdout.write(("\n" if found else "") + escape(f"job {args.job}: its pace, from the records of nodes "
                                                          f"{', '.join(pace['pace']['nodes'])} in the store") + "\n")
        sys.stdout.write(render_analysis(pace))
    return 0


def _store_pace(url: Any, job: str) -> dict[str, Any] | None:
    """The job's pace as its nodes last published it (the newest owner's, where two users ran a job
    of that name), judged: the slowest rank of the whole job and why; None when no node published one."""
    from .analyze import slow
    from .fleet import paces
    from .fleet.reader import ReadError

    try:
        records = paces.read(paces.client(), url, job)
    except Exception as exc:  # noqa: BLE001 - botocore's errors share no useful base; say what failed
        raise ReadError(f"store {url}: {type(exc).__name__}: {exc}") from None
    if not records:
        return None
    newest = max(records, key=lambda r: r.time)
    mine = [r for r in records if r.uid == newest.uid and newest.time - r.time <= paces.FRESH]
    mine.sort(key=lambda r: (r.node != newest.node, r.node))
    return slow.judge(mine).to_dict()


# -- check -----------------------------------------------------------------

def cmd_check(args: argparse.Namespace) -> int:
    import dataclasses

    from . import check, config

    dirs, daemon = _daemon_dirs(args)
    theirs = daemon.get("metrics_address") if daemon else None
    cfg = config.load(args.config, {**dirs, "metrics_address": args.metrics_address if args.metrics_address is not None else theirs})
    checks = check.run_checks(cfg, daemon)
    if args.json:
        _print_json([dataclasses.asdict(c) for c in checks])
    else:
        sys.stdout.write(check.render(checks))
    return 0 if all(c.ok or not c.required for c in checks) else 1


def _print_incident(args: argparse.Namespace, path: Path) -> int:
    """An incident for a person (text), a script (--json) or a ticket (--html)."""
    from .analyze.verdict import analyze
    from .report import incident

    # Derived from the files, so always redone: a trace added by hand later counts too.
    data = incident.load(path, analyze(path).to_dict())
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
    from .report import tables
    from .workload import beat_segment, runtime_files

    runtime_dir = Path(args.runtime_dir) if args.runtime_dir else client_runtime_dir()
    status = runtime_files.status(runtime_dir)
    if status is None:
        written = runtime_files.status_written(runtime_dir)
        last = f" (the last daemon's status was written {_when(written)})" if written else ""
        raise Failure(f"no daemon is running with runtime dir {runtime_dir}{last}; start one with 'hangwatchd daemon'")
    stale = _not_running(status)
    for p in status["processes"]:
        if p.get("beat_file"):  # fresher than the daemon's last write
            try:
                reading = beat_segment.read(p["beat_file"])
                p["last_beat_age"] = reading.age()
                p["beats"] = reading.count
            except beat_segment.SegmentError:
                pass
    if stale:  # what follows is an old picture: say so first, on stderr, and exit 1
        print(f"hangwatchd: {stale}", file=sys.stderr)
        status["daemon_running"] = False
    if args.json:
        _print_json(status)
    else:
        sys.stdout.write(tables.status(status))
    return 1 if stale else 0


def _when(t: float) -> str:
    return f"at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t))}, {max(0.0, time.time() - t):.0f} s ago"


def _not_running(status: dict[str, Any]) -> str | None:
    """Why the daemon behind a status is not watching now (stopped, or its loop silent), else None."""
    from .daemon.node_health import LOOP_STALLED_AFTER
    from .host import procfs

    pid = int((status.get("daemon") or {}).get("pid") or 0)
    written = status.get("time")
    when = _when(float(written)) if isinstance(written, (int, float)) else "at an unknown time"
    if procfs.state(pid) in ("T", "t"):
        return (f"the daemon (pid {pid}) is not running: it is stopped (SIGSTOP, or held by a debugger); "
                f"this is what it wrote {when}")
    if isinstance(written, (int, float)) and time.time() - written > LOOP_STALLED_AFTER:
        return (f"the daemon (pid {pid}) is not running its loop: its status was last written {when}; this is that "
                "old status ('hangwatchd health' judges it; systemctl restart hangwatchd)")
    return None


def _daemon_dirs(args: argparse.Namespace) -> tuple[dict[str, str | None], dict[str, Any] | None]:
    """The dirs a command shares with the daemon: each flag given, else the running daemon's own (its
    daemon.json in the runtime dir, as ``status`` finds it), else None (the config's); and that daemon.json."""
    from .workload import runtime_files

    runtime_dir = Path(args.runtime_dir) if getattr(args, "runtime_dir", None) else client_runtime_dir()
    info = runtime_files.daemon_info(runtime_dir)
    theirs = info or {}
    return {"state_dir": args.state_dir or theirs.get("state_dir"),
            "runtime_dir": getattr(args, "runtime_dir", None) or (str(runtime_dir) if info else None),
            "dump_dir": getattr(args, "dump_dir", None) or theirs.get("dump_dir")}, info


def _index(args: argparse.Namespace) -> Any:
    """The incident index of the state dir asked for: --state-dir, else the running daemon's,
    else the default. A state dir that does not exist is bad usage, said in one line."""
    from .incidents.index import Index

    state_dir = _daemon_dirs(args)[0]["state_dir"]
    if not state_dir:
        from . import config  # the default: only where neither a flag nor a running daemon says

        state_dir = config.Config().state_dir
    if not os.path.isdir(state_dir):
        why = "does not exist" if not os.path.lexists(state_dir) else "is not a directory"
        raise UsageError(f"state dir {state_dir} {why}; pass --state-dir with the daemon's state dir "
                         "('hangwatchd status' names it)")
    return Index(state_dir)


def _runtime_dir(args: argparse.Namespace) -> Path:
    return Path(args.runtime_dir) if getattr(args, "runtime_dir", None) else client_runtime_dir()


def _store_incidents(args: argparse.Namespace) -> int:
    from .fleet.reader import ReadError, job_incidents
    from .report import tables

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
    sys.stdout.write(tables.job_incidents(items))
    return 0


def _waiting(args: argparse.Namespace) -> list[Path]:
    """Reports the daemon keeps in its spool while the state dir has no room, oldest first."""
    spool_dir = _runtime_dir(args) / SPOOL[0]
    try:
        if not any(n.endswith(SPOOL[1]) for n in os.listdir(spool_dir)):
            return []  # none: the spool's module (and the daemon's imports) not loaded for nothing
    except OSError:
        return []
    from .incidents.spool import Spool

    return Spool(spool_dir).pending()


def cmd_incidents(args: argparse.Namespace) -> int:
    if args.store:
        if args.since is not None or args.before or args.limit is not None:
            raise UsageError("incidents --store: --limit, --since and --before page this node's incidents; "
                             "with --store give --job JOB or nothing")
        return _store_incidents(args)
    index = _index(args)
    limit = DEFAULT_LIMIT if args.limit is None else args.limit or None
    page = index.page(limit, args.since, args.job, args.before)
    waiting = _waiting(args)
    note = (f"{len(waiting)} incidents wait for room in {index.root} (kept in {waiting[0].parent}); "
            "they are listed once it has room") if waiting else ""
    if note and not page.items and not args.json:
        print(f"no incidents stored in {index.root}; {note}")
        return 0
    if note:  # on stderr: --json and the table stay what they are
        print(f"hangwatchd: {note}", file=sys.stderr)
    more = _more(args, page) if page.more else ""
    if args.json:
        _print_json(page.items)
        if more:
            print(f"hangwatchd: {more}", file=sys.stderr)
        return 0
    if not page.items:
        print(f"no incidents in {index.root}" + (f" for job {args.job}" if args.job else "")
              + (" in that time" if args.since is not None else "") + (f" before {args.before}" if args.before else ""))
        return 0
    from .report import tables

    sys.stdout.write(tables.incidents(page.items))
    if more:
        print(more)
    return 0


def _more(args: argparse.Namespace, page: Any) -> str:
    """What a listing cut at its limit left out, and the command for the next page."""
    again = ["hangwatchd incidents", "--before", page.items[-1]["id"]]
    since = None
    if args.since is not None:  # as a time, not an age: the next page is the same list, however much later
        import datetime

        since = datetime.datetime.fromtimestamp(args.since, datetime.timezone.utc).isoformat()
    for flag, value in (("--state-dir", args.state_dir), ("--runtime-dir", args.runtime_dir), ("--job", args.job),
                        ("--since", since), ("--limit", args.limit)):
        if value is not None:
            again += [flag, _quoted(str(value))]
    return (f"{page.more} older incident{'s' if page.more != 1 else ''} not listed (newest first, "
            f"{len(page.items)} shown); the next: {' '.join(again)}")


def _quoted(text: str) -> str:
    import shlex

    return shlex.quote(text)


def cmd_show(args: argparse.Namespace) -> int:
    args.id, args.html = show_target(args)
    if args.id is None:
        raise UsageError("show: give the incident's ID ('hangwatchd incidents' lists them); "
                         "usage: hangwatchd show ID [--html [FILE]]")
    index = _index(args)
    path = index.find(args.id)
    if path is None:
        waiting = next((p for p in _waiting(args) if p.name.startswith(args.id)), None)
        if waiting is not None:
            raise Failure(f"incident {args.id} waits for room in the state dir {index.root} (its report is kept in "
                          f"{waiting}); it is stored, and shown here, once the disk has room")
        raise UsageError(f"no incident '{args.id}' in {index.root}; 'hangwatchd incidents' lists them")
    return _print_incident(args, path)


def cmd_health(args: argparse.Namespace) -> int:
    """Node Problem Detector's custom plugin contract: one line on stdout; 0 OK, 1 the node is at fault, 3 unknown."""
    from .daemon.node_health import UNKNOWN, judge

    runtime_dir = Path(args.runtime_dir) if args.runtime_dir else client_runtime_dir()
    try:
        health = judge(runtime_dir, args.stalled_after)
    except Exception as exc:  # noqa: BLE001 - NPD reads any failure of ours as unknown, never as the node's fault
        print(f"hangwatchd health could not judge the node: {type(exc).__name__}: {exc}")
        return UNKNOWN
    print(health.line)
    return health.code


def cmd_suspects(args: argparse.Namespace) -> int:
    """The ledger of suspects: this node's, or every node's in the shared store."""
    from .incidents import ledger
    from .report import tables

    if args.store:
        from . import log
        from .fleet.reader import ReadError, ledger_entries

        log.configure("console", "warning")  # an entry refused is said on stderr; stdout stays the answer
        url = _store_url(args)
        try:
            entries = ledger_entries(url)
        except ReadError as exc:
            raise Failure(str(exc)) from None
        where = str(url)
    else:
        root = _index(args).root  # the state dir asked for, checked as `incidents` checks it
        try:
            entries = ledger.read(root, args.since)
        except ledger.LedgerError as exc:
            raise Failure(str(exc)) from None
        where = str(ledger.directory(root))
    found = ledger.suspects(entries, args.since)
    if args.json:
        _print_json(found)
        return 0
    if not found["gpus"] and not found["nodes"]:
        print(f"no incident in {where} blames a GPU" + (" in that time" if args.since is not None else ""))
        return 0
    sys.stdout.write(tables.suspects(found))
    return 0


COMMANDS = {"daemon": cmd_daemon, "run": cmd_run, "status": cmd_status, "incidents": cmd_incidents, "show": cmd_show,
            "capture": cmd_capture, "analyze": cmd_analyze, "check": cmd_check, "symbolize": cmd_symbolize,
            "health": cmd_health, "suspects": cmd_suspects}


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (``| head`` that has read its lines)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR)
        return any(ev & select.POLLERR for _fd, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def _quiet_stdout() -> None:
    """stdout's reader left: point it at /dev/null, so the interpreter's last flush has nowhere to fail."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


# What a job's own environment runs (with hangwatchd.beat() and register()): no third-party
# package, Python 3.9+. Every other command is the daemon side: Python 3.11+ and [daemon].
JOB_SIDE_COMMANDS = frozenset({"run"})


def _not_here(command: str, exc: ModuleNotFoundError) -> str:
    """One line for a command whose modules this environment lacks: a job-side install or bundle."""
    if (exc.name or "").split(".")[0] == "hangwatchd":  # hangwatchd-job.pyz holds the job side only
        return (f"hangwatchd {command} is not in this job-side bundle (it holds hangwatchd run, beat() and "
                "register()); run it where the daemon is installed")
    return (f"hangwatchd {command} needs the daemon's dependencies ({exc}); this environment has the job side only "
            "(hangwatchd run, beat(), register()): install the daemon with pip install 'hangwatchd[daemon]'")


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(COMMANDS, only=given[0] if given and given[0] in COMMANDS else None)
    args = parser.parse_args(given)
    if sys.version_info < (3, 11) and args.command not in JOB_SIDE_COMMANDS:
        import platform

        print(f"hangwatchd: hangwatchd {args.command} needs Python 3.11 or later (this is {platform.python_version()}); "
              "on this Python, hangwatchd run, hangwatchd.beat() and hangwatchd.register() work", file=sys.stderr)
        return 1
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit: a reader that left is seen while we can still answer it
        return code
    except BrokenPipeError:
        if not _reader_gone():
            raise  # some other pipe: a bug to see, not a reader that had enough
        # `hangwatchd incidents --json | head`: head read what it wanted; exit as quietly as it expects.
        _quiet_stdout()
        return 0
    except ModuleNotFoundError as exc:
        if args.command in JOB_SIDE_COMMANDS:
            raise  # the job side needs no other module: a bug to see
        print(f"hangwatchd: {_not_here(args.command, exc)}", file=sys.stderr)
        return 1
    except Exception as exc:
        if isinstance(exc, (UsageError, *_loaded(USAGE_ERRORS))):
            print(f"hangwatchd: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, (Failure, *_loaded(FAILURES))):
            print(f"hangwatchd: {exc}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
