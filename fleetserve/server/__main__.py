"""`python -m fleetserve.server MODEL [flags]`: the same as `fleetserve serve`."""

from __future__ import annotations

import argparse
import sys

from fleetserve.common.logs import configure_logging
from fleetserve.server.cli import add_arguments, run_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.server", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="Python logging level")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)
        return run_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
