"""`fleetserve router`: the router's command line, which refuses to run until the router exists.

Every flag is generated from `RouterConfig` and parsed through it, so the flags the operator
renders are checked exactly as the real router will check them; then the command exits 2 with one
line on stderr. Accepting the flags and serving nothing would be a silent lie.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fleetserve.api.router_config import RouterConfig

__all__ = ["NOT_IMPLEMENTED", "register"]

NOT_IMPLEMENTED = (
    "error: fleetserve router is not implemented in this build yet (issue 15); its flags parse,"
    " but nothing would route requests, so it refuses to start"
)


def _run(args: argparse.Namespace) -> int:
    RouterConfig.from_args(args)  # a bad value raises ValueError (the CLI prints it, exit 2)
    print(NOT_IMPLEMENTED, file=sys.stderr)
    return 2


def register(subparsers: Any) -> None:
    """Add the `router` subcommand to the top-level CLI's subparsers."""
    parser = subparsers.add_parser(
        "router", help="the OpenAI ingress (not implemented in this build: exits 2)"
    )
    RouterConfig.add_cli_args(parser)
    parser.set_defaults(func=_run)
