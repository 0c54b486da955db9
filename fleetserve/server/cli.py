"""`fleetserve serve MODEL`: engine flags (the `LLM` keywords with dashes) plus server flags."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

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
    parser.add_argument(
        "model", nargs="?", default=None, help="HF model folder (default: bundled SmolLM2)"
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    engine.add_argument("--device", default="auto", help="auto | cpu | cuda")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    engine.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    engine.add_argument("--attention-backend", default="auto",
                        help="auto | torch | triton | flash_attn")  # fmt: skip
    engine.add_argument("--custom-ops", default="auto",
                        help="auto | torch | triton (RMSNorm, rotary, SiLU kernels)")  # fmt: skip
    engine.add_argument("--enforce-eager", action="store_true",
                        help="never capture CUDA graphs")  # fmt: skip
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--load-format", default="safetensors",
                        help="safetensors | dummy (seeded random weights)")  # fmt: skip
    engine.add_argument("--tensor-parallel-size", type=int, default=1)
    engine.add_argument("--pipeline-parallel-size", type=int, default=1)
    engine.add_argument("--enable-expert-parallel", action="store_true")
    engine.add_argument("--enable-eplb", action="store_true")
    engine.add_argument("--kv-transfer-config", type=_json_object, default=None,
                        help="KV connector settings as a JSON object")  # fmt: skip
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None,
                        help="name clients use (default: the model folder's name)")  # fmt: skip
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes")  # fmt: skip
    server.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="waiting sequences beyond which requests get 429")  # fmt: skip
    server.add_argument("--stats-log-interval", type=float, default=10.0,
                        help="seconds between stats log lines (0 = off)")  # fmt: skip


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--kv-transfer-config is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--kv-transfer-config must be a JSON object")
    return value


def build_server_config(args: argparse.Namespace) -> Any:
    """Parsed flags → `ServerConfig` (raises ValueError naming a bad flag value)."""
    from pathlib import Path

    from fleetserve.engine.config import EngineConfig
    from fleetserve.server.app import ServerConfig

    model = args.model
    if model is None:
        from fleetserve.engine.models.bundled import bundled_model_path

        model = str(bundled_model_path())
    engine = EngineConfig.create(
        model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_eplb=args.enable_eplb,
        kv_transfer_config=args.kv_transfer_config,
        gpu_memory_utilization=args.gpu_memory_utilization,
        custom_ops=args.custom_ops,
        enforce_eager=args.enforce_eager,
        load_format=args.load_format,
    )
    return ServerConfig(
        engine=engine,
        served_model_name=args.served_model_name or Path(model).name,
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        stats_log_interval_s=args.stats_log_interval,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Serve until interrupted (SIGINT/SIGTERM shut the engine core down cleanly)."""
    from aiohttp import web

    from fleetserve.server.app import create_app

    config = build_server_config(args)
    logger.info("serving %s as %r on http://%s:%d", config.engine.model.model,
                config.served_model_name, args.host, args.port)  # fmt: skip
    # NOTE: handler_cancellation makes a client disconnect cancel its handler, which aborts the
    # request in the engine even while it waits for its first token.
    web.run_app(
        create_app(config),
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        access_log=None,
        print=None,
    )
    return 0
