"""The `fleetserve` command line: one entry point, one subcommand per component."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from fleetserve.common.logs import configure_logging


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    from fleetserve.engine.models.bundled import bundled_model_path

    print(bundled_model_path())
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from fleetserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for question in args.message:
        reply = llm.chat([{"role": "user", "content": question}], params)[0].outputs[0]
        print(f"user> {question}\nassistant> {reply.text.strip()}\n")
    return 0


_BENCHES = (
    ("offline", "offline", "offline throughput vs peers"),
    ("serve", "serve", "online serving benchmark (TTFT/TPOT/ITL)"),
    ("decode", "decode", "small-batch decode tok/s vs the weight-read roofline (CUDA graphs/eager)"),
    ("gemm", "gemm", "one decode step's dense GEMMs on the CPU: MKL, oneDNN, the small-row kernel"),
    ("attention", "attention", "one layer's prefill and decode attention on the CPU: fused kernel vs torch"),
    ("kv-transfer", "kv_transfer", "KV-block throughput and 4 KiB round trip of tcp, shm and mooncake"),
    ("router", "router", "a router's added latency and max requests/s vs vllm-router"),
    ("pd-handover", "pd_handover", "TTFT of a prefill/decode pair vs one engine, transfer split out"),
    ("parallel", "parallel", "decode step time of the mp executor vs uni (TP 1, 2) and all-reduce latency"),
    ("spec-decode", "spec_decode", "tokens/s with and without speculative decoding, acceptance rates"),
    ("moe", "moe", "one MoE layer's time per forward, EP=1 vs EP=2 (torch or triton experts)"),
    ("eplb", "eplb", "MoE layer time before/after an EPLB rebalance, rearrangement spike sync vs async"),
    ("quant", "quant", "int8/fp8 vs full precision: perplexity, top-1 agreement, weight memory, tok/s"),
    ("lora", "lora", "throughput of the base model vs a batch mixing several LoRA adapters"),
)  # fmt: skip
"""`fleetserve bench` subcommands: (name, module under fleetserve.bench, help). Each module has
`add_arguments(parser)` and `run_from_args(args) -> int`."""


_COMPONENTS: tuple[tuple[str, str], ...] = (
    ("serve", "fleetserve.server.cli"),
    ("dev-cluster", "fleetserve.devcluster.cli"),
    ("crds", "fleetserve.api.cli"),
    ("operator", "fleetserve.operator.cli"),
    ("up", "fleetserve.fleet.up"),
    ("router", "fleetserve.router.cli"),
)
"""Component subcommands: (name, module with `register(subparsers)`), in --help's order."""

TORCH_FREE_COMMANDS = frozenset({"dev-cluster", "crds", "operator", "up", "router"})
"""Subcommands whose processes never load torch: the operator's and the router's pods (the
operator's manifest limits it to 512Mi; torch alone takes more), the local fleet's supervisor,
the dev cluster and the CRD printer. For them `main` builds a parser with that subcommand only,
since the full one imports the engine's flags, and with them torch."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `fleetserve` parser: every subcommand, or with `only` (one of `TORCH_FREE_COMMANDS`)
    that subcommand alone, which imports no module of the others.

    Raises:
        ValueError: `only` is not one of `TORCH_FREE_COMMANDS`.
    """
    if only is not None and only not in TORCH_FREE_COMMANDS:
        raise ValueError(f"only must be one of {sorted(TORCH_FREE_COMMANDS)}, got {only!r}")
    parser = argparse.ArgumentParser(prog="fleetserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="Python logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    if only is None:
        _add_engine_commands(sub)
    for name, module in _COMPONENTS:
        if only in (None, name):
            importlib.import_module(module).register(sub)
    return parser


def _add_engine_commands(sub: Any) -> None:
    """`models`, `chat`, `bench` and `diag`: the commands that run the engine or its kernels."""
    models = sub.add_parser("models", help="manage the bundled model")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="convert the bundled GGUF into an HF folder")
    prepare.set_defaults(func=_cmd_models_prepare)

    chat = sub.add_parser("chat", help="chat with a model offline (LLM.chat)")
    chat.add_argument("message", nargs="+", help="user message(s), one reply each")
    chat.add_argument("--model", default=None, help="HF model folder (default: bundled SmolLM2)")
    chat.add_argument("--dtype", default="auto")
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--max-tokens", type=int, default=64)
    chat.set_defaults(func=_cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module_name, help_text in _BENCHES:
        module = importlib.import_module(f"fleetserve.bench.{module_name}")
        bench_parser = bench_sub.add_parser(name, help=help_text)
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(func=module.run_from_args)

    diag = sub.add_parser("diag", help="self-tests of a pod or a group")
    diag_sub = diag.add_subparsers(dest="diag_command", required=True)
    from fleetserve.engine.distributed import diag_comm

    comm = diag_sub.add_parser(
        "comm", help="layered communication self-test: device backend, gloo, shm, CUDA graph"
    )
    diag_comm.add_arguments(comm)
    comm.set_defaults(func=diag_comm.run_from_args)


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names: its first word that is neither an option nor --log-level's
    value (the full parser reports anything malformed)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    args = build_parser(command if command in TORCH_FREE_COMMANDS else None).parse_args(argv)
    try:
        configure_logging(args.log_level)
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
