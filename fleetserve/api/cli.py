"""`fleetserve crds`: print the generated CRD YAML (or write it to a file)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from fleetserve.api.crd import crd_yaml
    from fleetserve.api.role_adapter import role_crd_yaml

    text = role_crd_yaml() if args.role_adapter else crd_yaml()
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


def register(subparsers: Any) -> None:
    """Add the `crds` subcommand to the top-level CLI's subparsers."""
    parser = subparsers.add_parser("crds", help="print the InferenceDeployment CRD YAML")
    parser.add_argument("-o", "--output", default=None, help="write to this file instead")
    parser.add_argument(
        "--role-adapter",
        action="store_true",
        help="the InferenceDeploymentRole CRD (a role's scale subresource) instead",
    )
    parser.set_defaults(func=_run)
