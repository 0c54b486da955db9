"""`fleetserve serve MODEL`: the engine flags (generated from `EngineArgs`, the same names as the
`LLM` keywords with dashes) plus the server's own flags."""

from __future__ import annotations

import argparse
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetserve.common.ports import bind_port
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.engine_client import DEFAULT_MAX_PENDING_OUTPUTS
from fleetserve.envs import read_env
from fleetserve.openai.protocol import DEFAULT_MAX_PROMPTS_PER_REQUEST

if TYPE_CHECKING:
    from fleetserve.server.app import ServerConfig

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to the top-level CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve one model over the OpenAI-compatible HTTP API"
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags (generated from `EngineArgs`), then the server's own."""
    EngineArgs.add_cli_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None,
                        help="name clients use (default: the model folder's name)")  # fmt: skip
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes")  # fmt: skip
    server.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="waiting sequences beyond which requests get 429")  # fmt: skip
    server.add_argument("--max-prompts-per-request", type=int,
                        default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                        help="prompts one completions request may batch")  # fmt: skip
    server.add_argument("--max-pending-outputs", type=int, default=DEFAULT_MAX_PENDING_OUTPUTS,
                        help="unread outputs after which a slow client's request is aborted")  # fmt: skip
    server.add_argument("--stats-log-interval", type=float, default=10.0,
                        help="seconds between stats log lines (0 = off)")  # fmt: skip


def build_server_config(args: argparse.Namespace) -> ServerConfig:
    """Parsed flags → `ServerConfig` (raises ValueError naming a bad flag value)."""
    from fleetserve.server.app import ServerConfig

    engine_args = EngineArgs.from_cli_args(args)
    engine = engine_args.create_engine_config()
    return ServerConfig(
        engine=engine,
        served_model_name=args.served_model_name or Path(engine.model.model).name,
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        max_prompts_per_request=args.max_prompts_per_request,
        max_pending_outputs=args.max_pending_outputs,
        skip_tokenizer_init=engine_args.skip_tokenizer_init,
        stats_log_interval_s=args.stats_log_interval,
        allow_runtime_lora_updating=read_env().allow_runtime_lora_updating == 1,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Serve until interrupted (SIGINT/SIGTERM shut the engine core down cleanly).

    On a follower pod of a multi-pod group (the env the operator renders says so), run this
    pod's ranks instead (`fleetserve.engine.distributed.follower`): only pod 0 serves.
    """
    from aiohttp import web

    from fleetserve.server.app import create_app

    failed = _comm_check(args)
    if failed:
        return failed
    follower = _follower_exit_code(args)
    if follower is not None:
        return follower
    config = build_server_config(args)
    sock = claim_port(args.host, args.port)
    port = sock.getsockname()[1]
    logger.info("serving %s as %r on http://%s:%d", config.engine.model.model,
                config.served_model_name, args.host, port)  # fmt: skip
    # NOTE: handler_cancellation makes a client disconnect cancel its handler, which aborts the
    # request in the engine even while it waits for its first token.
    web.run_app(
        create_app(config),
        sock=sock,
        handler_cancellation=True,
        access_log=None,
        print=None,
    )
    return 0


def claim_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound now; it listens once the app serves (asyncio listens on a
    socket it is given), after the engine started.

    So the port is the server's from start-up on: nothing else takes it while the model loads
    (a port chosen free moment earlier could be, by any outgoing connection), a port in use fails
    at once rather than after the load, and until the engine is up connections are refused, as
    they were when the server bound late, rather than left waiting in the backlog.

    Raises:
        ValueError: `host`:`port` cannot be bound (the message names --host/--port and why).
    """
    return bind_port(host, port, what="--host/--port")


COMM_CHECK_TIMEOUT_S = 60.0
"""Per layer of the start-up self-test (the group's pods start within about this of each other)."""


def _comm_check(args: argparse.Namespace) -> int:
    """With FLEETSERVE_COMM_CHECK=1 and several ranks, the layered self-test over this pod's
    ranks (`diag_comm`); 0 when it passed (or does not apply), else 1 after logging the failure."""
    from fleetserve.engine.distributed.diag_comm import diagnose, first_failure, group_ranks
    from fleetserve.envs import read_env

    env = read_env()
    engine_args = EngineArgs.from_cli_args(args)
    world = (
        engine_args.tensor_parallel_size
        * engine_args.pipeline_parallel_size
        * engine_args.data_parallel_size
    )
    if not env.comm_check or world == 1:
        return 0
    ranks, init_method = group_ranks(env, world)
    device = engine_args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    results = diagnose(ranks, world, init_method, device, COMM_CHECK_TIMEOUT_S)
    failure = first_failure(results)
    if failure is not None:
        logger.error(
            "communication self-test failed at layer %r (rank %d): %s; likely cause: %s",
            failure.layer, failure.rank, failure.detail, failure.cause,
        )  # fmt: skip
        return 1
    layers = sorted({f"{r.layer}: {r.status}" for r in results})
    logger.info("communication self-test of ranks %s passed (%s)", ranks, ", ".join(layers))
    return 0


def _follower_exit_code(args: argparse.Namespace) -> int | None:
    """Run this pod as a follower of its group if it is one (its exit code), else None."""
    from fleetserve.engine.distributed.pod_group import pod_group
    from fleetserve.envs import read_env

    env = read_env()
    engine_args = EngineArgs.from_cli_args(args)
    world = (
        engine_args.tensor_parallel_size
        * engine_args.pipeline_parallel_size
        * engine_args.data_parallel_size
    )
    group = pod_group(env, world)
    if group is None or group.is_leader:
        return None
    from fleetserve.engine.distributed.follower import run_follower

    return run_follower(
        engine_args.create_engine_config(env), group, host=args.host, port=args.port
    )
