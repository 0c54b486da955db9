"""`fleetserve operator`: run the kopf operator (standalone by default, liveness endpoint)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

__all__ = ["log_like_kopf_run", "register", "run"]


def log_like_kopf_run() -> None:
    """Log as `kopf run` does: kopf's format, each line about an object led by its
    `[namespace/name]` (without it, "Handler 'on_pod_event' succeeded." names no pod). The level
    the CLI set (--log-level) stays."""
    import kopf

    root = logging.getLogger()
    level = root.level
    root.handlers.clear()  # the CLI's handler would print every line a second time
    kopf.configure(log_format=kopf.LogFormat.FULL, log_prefix=True)
    root.setLevel(level)


def run(
    *,
    namespaces: list[str],
    peering: str | None,
    liveness: str | None,
    metrics: str | None = None,
) -> None:
    """Run the operator until interrupted (blocks); `metrics` HOST:PORT serves its
    `fleetserve:autoscaler_*` metrics at /metrics (None: not served)."""
    import kopf

    import fleetserve.operator.handlers  # noqa: F401  (registers the handlers)

    asyncio.run(
        kopf.operator(
            standalone=peering is None,
            peering_name=peering,
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=liveness,
            memo=kopf.Memo(metrics_address=metrics),
        )
    )


def _run(args: argparse.Namespace) -> int:
    log_like_kopf_run()
    run(
        namespaces=args.namespace,
        peering=args.peering,
        liveness=args.liveness or None,
        metrics=args.metrics or None,
    )
    return 0


def register(subparsers: Any) -> None:
    """Add the `operator` subcommand to the top-level CLI's subparsers."""
    parser = subparsers.add_parser("operator", help="run the InferenceDeployment operator")
    parser.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch only these (repeatable)"
    )
    parser.add_argument(
        "--peering", default=None, help="kopf peering name (default: off, standalone)"
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL ('' to disable)",
    )
    parser.add_argument(
        "--metrics",
        default="0.0.0.0:8081",
        help="HOST:PORT of the operator's own /metrics (the autoscaler's; '' to disable)",
    )
    parser.set_defaults(func=_run)
