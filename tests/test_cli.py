"""The command line as a newcomer meets it: every --help, --version, ./dev's own usage."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from hangwatchd import __version__

from .conftest import hangwatchd

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["daemon", "run", "status", "incidents", "show", "capture", "analyze", "check", "symbolize", "health"]


def _sections(text: str) -> dict[str, list[str]]:
    """argparse's help, cut into its sections: the text before the first heading is 'description'."""
    sections: dict[str, list[str]] = {"description": []}
    current = "description"
    for line in text.splitlines()[1:]:
        heading = re.fullmatch(r"([a-z][a-z ]*):", line)
        if heading:
            current = heading.group(1)
            sections[current] = []
        elif not line.startswith("  ") and line and current != "description" and sections[current] and not line.startswith(" "):
            current = "description"
            sections[current].append(line)
        else:
            sections[current].append(line)
    return sections


def _entries(lines: list[str]) -> dict[str, str]:
    """Each option or positional of a section with the help text printed for it."""
    entries: dict[str, str] = {}
    name = None
    for line in lines:
        m = re.match(r"  (\S.*?)(?:\s{2,}(\S.*))?$", line)
        if m and not line.startswith("   "):
            name = m.group(1)
            entries[name] = m.group(2) or ""
        elif name and line.strip():
            entries[name] += " " + line.strip()
    return entries


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_explains_itself(command: str) -> None:
    res = hangwatchd(command, "--help")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    sections = _sections(res.stdout)
    description = " ".join(sections["description"]).strip()
    assert len(description.split()) >= 8, f"{command}: no description in\n{res.stdout}"
    examples = [ln.strip() for ln in sections.get("examples", []) if ln.strip()]
    assert examples and all(e.startswith(f"hangwatchd {command}") for e in examples), res.stdout
    options = _entries(sections.get("options", []))
    positionals = _entries(sections.get("positional arguments", []))
    assert len(options) > 1, res.stdout  # more than -h
    for name, text in {**options, **positionals}.items():
        assert len(text.split()) >= 3, f"{command}: '{name}' has no help in\n{res.stdout}"
    for name, text in options.items():
        if " " in name.split(",")[-1].strip():  # it takes a value: say what it is without one
            assert "default" in text, f"{command}: '{name}' does not show its default: {text}"


def test_the_flags_a_newcomer_asked_about_say_their_defaults() -> None:
    daemon = _entries(_sections(hangwatchd("daemon", "--help").stdout)["options"])
    by_flag = {k.split()[0]: v for k, v in daemon.items()}
    assert "(default: json)" in by_flag["--log-format"]
    assert "(default: info)" in by_flag["--log-level"]
    assert "config/hangwatchd.toml" in by_flag["--config"]
    capture = _sections(hangwatchd("capture", "--help").stdout)
    assert "the process to capture" in _entries(capture["positional arguments"])["PID"]


def test_version() -> None:
    res = hangwatchd("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"hangwatchd {__version__}"


def test_the_top_level_help_lists_every_command() -> None:
    res = hangwatchd("--help")
    assert res.returncode == 0
    for command in COMMANDS:
        assert re.search(rf"^    {command}\b", res.stdout, re.M), command


def test_a_duration_flag_takes_units_and_refuses_garbage(tmp_path: Path) -> None:
    res = hangwatchd("run", "--runtime-dir", str(tmp_path), "--heartbeat-timeout", "soon", "--", "true")
    assert res.returncode == 2 and "'soon': expected a number of seconds" in res.stderr


def dev(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "dev"), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["demo", "--help"], ["bench", "--help"]])
def test_dev_prints_its_usage_and_runs_nothing(args: list[str]) -> None:
    res = dev(*args)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: ./dev") and "example" in res.stdout
    assert "demo: state and runtime dirs" not in res.stdout + res.stderr  # the demo did not start


def test_dev_with_an_unknown_command_exits_2() -> None:
    res = dev("frobnicate")
    assert res.returncode == 2 and res.stderr.startswith("usage: ./dev")


def test_the_docs_list_every_command_and_its_flags() -> None:
    readme = (ROOT / "docs" / "watching.md").read_text()  # the command reference; the README links it
    block = readme[readme.index("## `hangwatchd daemon` and `hangwatchd run`"):]
    block = block[block.index("```sh"):block.index("```", block.index("```sh") + 5)]
    for command in COMMANDS:
        assert f"hangwatchd {command}" in block, command
    assert "hangwatchd --version" in block
    daemon_flags = set(re.findall(r"--[a-z-]+", _sections(hangwatchd("daemon", "--help").stdout)["options"].__str__())) - {"--help"}
    assert daemon_flags <= set(re.findall(r"--[a-z-]+", block)), daemon_flags - set(re.findall(r"--[a-z-]+", block))


def test_the_command_line_finds_the_runtime_dir_as_the_config_says() -> None:
    """cli names the runtime dir's default and variable without importing the config: the same ones."""
    from hangwatchd import cli, config

    assert (cli.RUNTIME_DIR_ENV, cli.DEFAULT_RUNTIME_DIR) == (config.RUNTIME_DIR_ENV, config.DEFAULT_RUNTIME_DIR)
