"""`fleetserve bench lora`: throughput of the base model vs a batch mixing several adapters.

One workload (random token-id prompts, greedy, EOS ignored, so every run makes the same number
of tokens), three runs of it:

- `base (no LoRA)`: an engine started without `--enable-lora` (the baseline);
- `base (LoRA on)`: every request on the base model of an engine with `--enable-lora`
  (what serving adapters costs requests that use none);
- `mixed N adapters`: request i under adapter i mod N, all in the same batches (each step
  mixes the N adapters: the batched LoRA matmul of `fleetserve.engine.lora.ops`).

The adapters are random rank-`--rank` PEFT folders on every projection (q, k, v, o, gate, up,
down), written to a temporary folder. The engines stay loaded and the runs alternate
`--repeats` times (the box is shared and noisy); the median of each is printed side by side,
with its ratio to the baseline.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class RunResult:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: bundled SmolLM2)")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; median shown")
    parser.add_argument("--output-json", default=None, help="write the results here")


def write_random_adapters(
    hf_config: dict[str, Any], out: Path, count: int, rank: int, seed: int
) -> list[Path]:
    """`count` PEFT LoRA folders of random weights on every projection of the model."""
    import torch
    from safetensors.torch import save_file

    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    kv = int(hf_config.get("num_key_value_heads", heads)) * head_dim
    inter = int(hf_config["intermediate_size"])
    shapes = {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip
    groups = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "o_proj": "self_attn"}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    folders = []
    for index in range(count):
        tensors = {}
        for layer in range(int(hf_config["num_hidden_layers"])):
            for name in PROJECTIONS:
                fan_in, fan_out = shapes[name]
                stem = f"base_model.model.model.layers.{layer}.{groups.get(name, 'mlp')}.{name}"
                tensors[f"{stem}.lora_A.weight"] = 0.02 * torch.randn(
                    rank, fan_in, generator=generator
                )
                tensors[f"{stem}.lora_B.weight"] = 0.02 * torch.randn(
                    fan_out, rank, generator=generator
                )
        folder = out / f"adapter-{index}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                  "target_modules": list(PROJECTIONS)}  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config))
        folders.append(folder)
    return folders


def _max_lora_rank(rank: int) -> int:
    from fleetserve.engine.lora.config import SUPPORTED_MAX_RANKS

    fitting = [r for r in SUPPORTED_MAX_RANKS if r >= rank]
    if not fitting:
        raise SystemExit(f"--rank must be <= {SUPPORTED_MAX_RANKS[-1]}")
    return fitting[0]


def run_from_args(args: argparse.Namespace) -> int:
    from fleetserve import LLM, SamplingParams
    from fleetserve.engine.lora.request import LoRARequest

    if args.num_adapters < 1:
        raise SystemExit("--num-adapters must be >= 1")
    common = {"dtype": args.dtype, "max_num_seqs": max(args.num_prompts, 1)}
    plain = LLM(args.model, **common)
    lora = LLM(
        args.model, enable_lora=True, max_loras=args.num_adapters,
        max_lora_rank=_max_lora_rank(args.rank), **common,
    )  # fmt: skip
    rng = random.Random(args.seed)
    vocab = plain.config.model.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="fleetserve-bench-lora-") as tmp:
        folders = write_random_adapters(
            plain.config.model.hf_config, Path(tmp), args.num_adapters, args.rank, args.seed
        )
        adapters = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(folders)]
        mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
        runs: dict[str, tuple[LLM, list[LoRARequest | None]]] = {
            "base (no LoRA)": (plain, [None] * len(prompts)),
            "base (LoRA on)": (lora, [None] * len(prompts)),
            f"mixed {len(adapters)} adapters": (lora, list(mixed)),
        }
        for llm, loras in runs.values():  # warm-up: loads the adapters once
            llm.generate(
                prompts[: len(adapters)],
                params.clone(max_tokens=2),
                lora_request=loras[: len(adapters)],
            )
        results: dict[str, list[RunResult]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (llm, loras) in runs.items():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, lora_request=loras)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                results[name].append(RunResult(name, seconds, tokens))
    medians = [sorted(r, key=lambda x: x.seconds)[len(r) // 2] for r in results.values()]
    baseline = medians[0].tokens_per_s
    print(
        f"model {plain.config.model.model}, {args.num_prompts} prompts x {args.input_len} "
        f"tokens -> {args.output_len} tokens, rank {args.rank}, median of {args.repeats}"
    )
    print(f"{'run':<22} {'output tok/s':>13} {'vs base':>8}")
    for result in medians:
        print(
            f"{result.name:<22} {result.tokens_per_s:>13.1f} {result.tokens_per_s / baseline:>7.2f}x"
        )
    if args.output_json:
        rows = [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in medians]
        Path(args.output_json).write_text(json.dumps(rows, indent=2))
    return 0
