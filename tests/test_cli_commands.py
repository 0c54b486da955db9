"""`fleetserve`'s entry point: the subcommands whose processes must stay small (the operator's and
the router's pods, the local fleet's supervisor) load no torch, checked in fresh subprocesses
through `sys.modules`; the full parser still offers every subcommand."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from fleetserve.cli import TORCH_FREE_COMMANDS, _command, build_parser

ALL_COMMANDS = {"models", "chat", "bench", "diag", "serve", "dev-cluster", "crds", "operator",
                "up", "router"}  # fmt: skip


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(action.choices)


@pytest.mark.parametrize("command", sorted(TORCH_FREE_COMMANDS))
def test_a_torch_free_command_loads_no_torch(command: str) -> None:
    code = (
        "import sys\n"
        "from fleetserve.cli import main\n"
        "try:\n"
        f"    main(['--log-level', 'warning', {command!r}, '--help'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"usage: fleetserve {command}" in out.stdout
    assert out.stdout.split()[-2:] == ["0", "False"], out.stdout[-2000:]


def test_the_full_parser_offers_every_command_and_a_torch_free_one_only_its_own() -> None:
    assert set(_subcommands(build_parser())) == ALL_COMMANDS
    assert TORCH_FREE_COMMANDS < ALL_COMMANDS
    for command in TORCH_FREE_COMMANDS:
        assert _subcommands(build_parser(command)) == [command]
    with pytest.raises(ValueError, match=r"only must be one of .*'router'.*got 'serve'"):
        build_parser("serve")


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["router", "--port", "1"], "router"),
        (["--log-level", "debug", "operator"], "operator"),
        (["--log-level=debug", "up"], "up"),
        (["--help"], None),
        ([], None),
        (["--log-level"], None),
    ],
)
def test_the_command_is_the_first_word_that_is_no_option(
    argv: list[str], command: str | None
) -> None:
    assert _command(argv) == command
