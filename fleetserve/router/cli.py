"""`fleetserve router`: run the OpenAI router (`fleetserve.router.app`) until interrupted.

Every flag is generated from `RouterConfig` and parsed through it, so the flags the operator
renders are checked exactly as the router uses them; a bad value exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from fleetserve.api.router_config import RouterConfig

__all__ = ["register"]

logger = logging.getLogger("fleetserve.router")


def _run(args: argparse.Namespace) -> int:
    config = RouterConfig.from_args(args)  # a bad value raises ValueError (the CLI prints it)
    from fleetserve.router.app import create_app
    from fleetserve.router.serve import serve_until_signalled

    app = create_app(config)
    logger.info("router listening on %s:%d (%s discovery, disaggregation %s)",
                config.host, config.port, config.discovery, config.mode)  # fmt: skip
    serve_until_signalled(app, config.host, config.port)
    return 0


def register(subparsers: Any) -> None:
    """Add the `router` subcommand to the top-level CLI's subparsers."""
    parser = subparsers.add_parser(
        "router", help="the OpenAI router in front of prefill, decode and colocated engines"
    )
    RouterConfig.add_cli_args(parser)
    parser.set_defaults(func=_run)
