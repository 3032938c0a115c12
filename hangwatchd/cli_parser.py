"""The ``hangwatchd`` command line's grammar: every subcommand, its flags, its help.

Kept apart from what the commands do (``cli``), so the help a user reads is
in one place.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

Command = Callable[[argparse.Namespace], int]
DEFAULT_LIMIT = 100  # incidents `hangwatchd incidents` lists without --limit


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

    def _expand_help(self, action: argparse.Action) -> str:
        return _fill_defaults(super()._expand_help(action))

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap  # here: only help is filled, and every command would pay for it

        return "\n".join(line if not line or line.startswith("  ") else
                         textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         for line in text.splitlines())


def _default(key: str) -> str:
    """A config key's default in a help text, filled in only when help is printed: importing the
    config costs every command (`symbolize` most) tens of milliseconds it does not need."""
    return f"{{default:{key}}}"


_DEFAULT = re.compile(r"\{default:([a-z_]+)\}")


def _fill_defaults(text: str) -> str:
    from .config import KEYS

    def value(m: re.Match[str]) -> str:
        v = KEYS[m.group(1)].default
        return '""' if v == "" else str(v)
    return _DEFAULT.sub(value, text)


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


_AGE = re.compile(r"([0-9]+(?:\.[0-9]*)?)\s*(s|m|h|d|w)?")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, None: 1}


def _since(text: str) -> float:
    """argparse type for --since: a Unix time from an age ("90m", "2h", "7d": that long ago) or a
    time in ISO 8601 ("2026-11-29", "2026-11-29T19:00", "...Z", "...+02:00"), UTC unless it says."""
    import time

    age = _AGE.fullmatch(text.strip())
    if age:
        return time.time() - float(age.group(1)) * _AGE_UNITS[age.group(2)]
    import datetime

    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a time (2026-11-29T19:00, UTC unless it names a zone) "
                                         "or an age (90m, 2h, 7d)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def _limit(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number, 0 for no limit")
    return n


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def show_target(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``show``'s (ID, --html FILE): ``show ID --html FILE``, ``show --html FILE ID``, ``show ID
    --html`` and ``show --html ID`` all mean what they say. ID is None when none was given."""
    if args.id is None and args.html:
        return args.html, ""
    return args.id, args.html


class _Skipped:
    """A subcommand not asked for: its flags are not made (``build_parser``'s ``only``)."""

    def add_argument(self, *_args: object, **_kw: object) -> None:
        pass


def build_parser(commands: Mapping[str, Command], only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``commands`` maps each subcommand's name to the function that runs it.
    ``only``: the subcommand the arguments name, the one parser made with its flags (the others
    cost `hangwatchd incidents` 2 ms of its 40); None for all, as help and bad usage need."""
    from . import __version__

    def command(name: str, *args: Any, **kw: Any) -> Any:
        return _command(sub, name, *args, **kw) if only in (None, name) else _Skipped()

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

    d = command("daemon", commands["daemon"], "run the watchdog in the foreground (a systemd Type=notify service)",
                 "Watch every registered (and, with discover = true, every GPU) process; declare a hang when its "
                 "heartbeat or its stack stops; capture, explain and store an incident; serve /metrics. "
                 "Flags override the config file. Runs until SIGTERM.",
                 ["hangwatchd daemon --config /etc/hangwatchd/hangwatchd.toml",
                  "hangwatchd daemon --state-dir /tmp/hw --runtime-dir /tmp/hw-run --log-format console"],
                 [config_file])
    d.add_argument("--state-dir", help=f"incidents and their index (default: {_default('state_dir')})")
    d.add_argument("--runtime-dir", help="registrations, heartbeat segments, pipes; workloads find it through "
                                         f"$HANGWATCHD_RUNTIME_DIR (default: {_default('runtime_dir')})")
    d.add_argument("--dump-dir", help="where CUDA writes coredumps (default: STATE_DIR-dumps, beside the state dir)")
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

    r = command("run", commands["run"], "run a workload watched: hangwatchd run [options] -- CMD ...",
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
    r.add_argument("--on-hang", choices=["report", "abort"],
                   help="once a hang's incident is stored: report (no signal) or abort (the daemon sends its "
                        "ranks on each node SIGABRT, then SIGKILL after abort_grace; this command exits non-zero) "
                        "(default: the daemon's on_hang, report unless the node's admin chose otherwise). Either "
                        "way, a confirmed hang gets a GPU dump, which ends the process, unless the daemon's "
                        "gpu_dump is never")
    r.add_argument("--runtime-dir", help="the daemon's runtime dir (default: $HANGWATCHD_RUNTIME_DIR, "
                                         f"else {_default('runtime_dir')})")
    r.add_argument("--no-introspect", dest="introspect", action="store_false",
                   help="do not install the in-process reporter (a sitecustomize on the job's PYTHONPATH and one "
                        "idle thread per Python process, which tells the daemon what each thread waits on and holds); "
                        "HANGWATCHD_INTROSPECT=0 does the same")
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the workload and its arguments")

    command("status", commands["status"], "every watched process: job, rank, state, last beat, timeout",
             "Ask the running daemon (through its runtime dir) what it watches: each process's job, rank, state, "
             "last beat, timeout (and where it came from) and incident.",
             ["hangwatchd status", "hangwatchd status --json | jq '.processes[] | select(.state != \"healthy\")'"],
             [dirs, as_json])

    i = command("incidents", commands["incidents"], "stored incidents, newest first",
                 "List the incidents in the state dir, newest first: id, time, reason, job, pids and a one-line summary. "
                 "A listing cut at its --limit ends with how many more there are and the command for the next page. "
                 "With --store, list the job incidents of a shared store across nodes.",
                 ["hangwatchd incidents", "hangwatchd incidents --since 2h --job llama",
                  "hangwatchd incidents --limit 0 --since 2026-11-29 --json",
                  "hangwatchd incidents --store s3://hangwatchd-incidents/prod --job llama"],
                 [dirs, as_json])
    i.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="list job incidents across nodes from this shared store (default: this node's state dir)")
    i.add_argument("--job", help="only this job's incidents, here or with --store (default: every job)")
    i.add_argument("--limit", type=_limit, metavar="N",
                   help=f"at most N incidents, the newest; 0 for every one (default: {DEFAULT_LIMIT})")
    i.add_argument("--since", type=_since, metavar="TIME",
                   help="only incidents from TIME on: a time (2026-11-29T19:00, UTC unless it names a zone) or an "
                        "age (90m, 2h, 7d) (default: any time)")
    i.add_argument("--before", metavar="ID",
                   help="only incidents older than incident ID: the next page of a listing that ended at ID "
                        "(default: from the newest)")

    sh = command("show", commands["show"], "the report of one incident",
                  "Print one incident: the verdict, each process's capture steps and stacks, the analysis across "
                  "ranks. Each stored incident also holds this page as report.html.",
                  ["hangwatchd show 20261129T192301Z-854e77", "hangwatchd show 20261129T19 --html report.html",
                   "hangwatchd show --html report.html 20261129T19", "hangwatchd show --html 20261129T19"],
                  [dirs, as_json])
    sh.usage = "hangwatchd show [-h] [--state-dir STATE_DIR] [--runtime-dir RUNTIME_DIR] [--json] [--html [FILE]] ID"
    # nargs="?": with --html's FILE optional, "show --html ID" hands the one word to --html;
    # show_target() gives it back to ID (a lone word is the id: it is the one that is required).
    sh.add_argument("id", metavar="ID", nargs="?",
                    help="incident id, as 'hangwatchd incidents' lists it (a unique prefix will do); required")
    sh.add_argument("--html", nargs="?", const="", metavar="FILE",
                    help="write one self-contained HTML page and print its path (default FILE: ./hangwatchd-ID.html)")

    c = command("capture", commands["capture"], "capture a process's evidence now, into a new incident",
                 "Run the capture steps on PID by hand, as the daemon does on a hang, and store an incident. "
                 "Without --gpu-dump the process keeps running.",
                 ["hangwatchd capture 4174", "hangwatchd capture --gpu-dump 4174"],
                 [dirs, as_json, config_file])
    c.add_argument("pid", type=int, metavar="PID", help="the process to capture (yours, or any as root)")
    c.add_argument("--gpu-dump", action="store_true", help="also take a CUDA coredump (this ends the process)")

    an = command("analyze", commands["analyze"], "explain an incident directory: each rank's verdict, the rank that diverged",
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

    ck = command("check", commands["check"], "can this node do the job? ptrace, py-spy, nvdisasm, NVML, dirs, port, inotify",
                  "Check what the daemon needs on this node and say how to fix what is missing. "
                  "Exit status 1 when a required check fails.",
                  ["hangwatchd check", "hangwatchd check --config /etc/hangwatchd/hangwatchd.toml --json"],
                  [dirs, as_json, config_file])
    ck.add_argument("--dump-dir", help="where CUDA writes coredumps (default: STATE_DIR-dumps, beside the state dir)")
    ck.add_argument("--metrics-address", metavar="HOST:PORT",
                    help=f"the address to check is free (default: {_default('metrics_address')})")

    h = command("health", commands["health"], "is the node at fault? Node Problem Detector's custom plugin contract",
                 "One line on stdout and the exit status NPD's custom plugins use: 0 the node is fine, 1 the node is at "
                 "fault (a GPU that needs a reset or is lost, a GPU that suspect_jobs different jobs' incidents "
                 "implicated within suspect_window, or hangwatchd cannot watch: not running, its loop stalled, "
                 "py-spy or ptrace unusable), 3 unknown. A job's own hang, or a program's own GPU fault (XID 13, "
                 "31), is never the node's fault: it is 0 here, and surfaces through its alert and its incident.",
                 ["hangwatchd health", "hangwatchd health --runtime-dir /run/hangwatchd"])
    h.add_argument("--stalled-after", type=_duration, default=30.0, metavar="DURATION",
                   help="the daemon's loop is stalled when it has not written its status for this long (default: 30 s)")
    h.add_argument("--runtime-dir", help="the daemon's runtime dir (default: $HANGWATCHD_RUNTIME_DIR, "
                                         f"else {_default('runtime_dir')})")

    su = command("suspects", commands["suspects"], "GPUs and nodes that incidents keep blaming, most suspect first",
                  "List the GPUs (by UUID, with their serial and node) and the nodes that the incidents' verdicts "
                  "implicate: a fault of the GPU or its node, or a program's own GPU fault there. Each with the "
                  "incidents, jobs and users behind it, and a score that grows with different jobs and users, not "
                  "with one job's repeats (jobs + users - 1). This node's ledger (root's: it names every user's "
                  "jobs), or with --store every node's.",
                  ["hangwatchd suspects", "hangwatchd suspects --since 7d --json",
                   "hangwatchd suspects --store s3://hangwatchd-incidents/prod"],
                  [dirs, as_json])
    su.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                    help="read every node's ledger from this shared store (default: this node's state dir)")
    su.add_argument("--since", type=_since, metavar="TIME",
                    help="only incidents from TIME on: a time (2026-11-29T19:00, UTC unless it names a zone) or an "
                         "age (90m, 2h, 7d) (default: every entry kept)")

    s = command("symbolize", commands["symbolize"], "explain a CUDA coredump: kernels, warps, exceptions, inline chains",
                 "Read a CUDA coredump (.nvcudmp) in pure Python: every kernel, every warp's PC grouped, each "
                 "exception with its source line and whole inline chain.",
                 ["hangwatchd symbolize core_node7.4174.nvcudmp", "hangwatchd symbolize --json dump.nvcudmp.zst | jq .exceptions"],
                 [as_json])
    s.add_argument("dump", metavar="DUMP", help="the coredump (raw, or compressed .xz/.gz/.zst)")
    s.add_argument("--cuda-gdb", action="store_true", help="also run cuda-gdb, where installed, and show its answer")
    s.add_argument("--chains", choices=["line-table", "nvdisasm"], default="line-table",
                   help="where inline chains come from: the cubins' line tables (fast) or nvdisasm -gi (default: line-table)")
    return p
