"""`fleetserve bench quant`: a quantized engine next to the full-precision one, in one run.

For each engine (default: fp32 and online int8 weight-only, on the bundled SmolLM2-135M) it
prints, side by side:

- perplexity of a fixed English text (teacher-forced prompt logprobs; the text is below, so the
  figure is reproducible);
- top-1 agreement: the fraction of the text's positions where the engine's argmax next token
  equals the baseline's (the first row's);
- weight memory: bytes of the linear layers' parameters, and of all parameters;
- decode tokens/s at batch 1 and 8 (median step time of `--steps` decode steps after prefill,
  one `EngineCore` per engine, as `fleetserve bench decode` times them).

`--matmul` adds the int8 weight-only matmul alternatives on the model's projection shapes:
torch's int8 kernel (`torch._weight_int8pack_mm`, what the int8 method uses on the CPU) vs
dequantizing per call, with the engine dtype's `F.linear` as the baseline.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FIXED_TEXT = (
    "The old lighthouse stood at the edge of the harbour for more than a century. Every evening "
    "the keeper climbed the spiral stairs, trimmed the wick and polished the great lens until it "
    "shone. Ships coming home through the fog looked for its beam, and fishermen said that as "
    "long as the light turned, the sea would give them back. When the keeper grew too old for "
    "the stairs, the town installed an electric lamp with a timer, and for a while nobody "
    "noticed any difference. Then one winter a storm cut the power for three nights. The old "
    "keeper, who lived in a cottage below the cliff, took his lantern and a can of oil and "
    "climbed the stairs again, one slow step at a time. He kept the light burning until the "
    "lines were repaired, and afterwards the town council voted to keep the old lamp in working "
    "order, just in case. Children still visit the lighthouse on school trips. They count the "
    "steps, look out over the water and ask the guide whether the keeper was ever afraid. The "
    "guide always gives the same answer: he was afraid of the dark, and that is why he kept the "
    "light."
)


@dataclass(frozen=True, slots=True)
class QuantRow:
    name: str
    perplexity: float
    top1_agreement: float
    linear_weight_mib: float
    all_weight_mib: float
    tokens_per_s: dict[int, float]


def _param_mib(model: Any) -> tuple[float, float]:
    from fleetserve.engine.layers.linear import Linear

    seen: set[int] = set()
    linear = total = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:  # a tied head shares the embedding
                continue
            seen.add(id(param))
            size = param.numel() * param.element_size()
            total += size
            linear += size if isinstance(module, Linear) else 0
    return linear / 2**20, total / 2**20


def _text_logprobs(llm: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Per position after the first: the argmax next token and the text's own token logprob."""
    from fleetserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    rows = out.prompt_logprobs[1:]
    top1 = [next(t for t, lp in row.items() if lp.rank == 1) for row in rows]
    own = [row[tok].logprob for row, tok in zip(rows, prompt[1:], strict=True)]
    return top1, own


def _decode_tokens_per_s(llm: Any, batch: int, steps: int, input_len: int, seed: int) -> float:
    import torch

    from fleetserve.engine.sampling_params import SamplingParams

    core = llm.engine_core
    rng = random.Random(seed + batch)
    vocab = llm.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for req_id in ids:
        core.add_request(req_id, [rng.randrange(3, vocab) for _ in range(input_len)], params,
                         eos_token_ids=())  # fmt: skip
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.req_id for out in core.step() if out.new_token_ids)
    cuda = llm.config.device.device == "cuda"
    samples = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        core.step()
        samples.append(time.perf_counter() - start)
    while core.has_unfinished_requests():
        core.step()
    samples = samples[len(samples) // 5 :]
    return batch / sorted(samples)[len(samples) // 2]


def run_engine(
    name: str, model: str, args: argparse.Namespace, baseline_top1: list[int] | None,
    prompt: list[int],
) -> tuple[QuantRow, list[int], list[tuple[int, int]]]:  # fmt: skip
    import math

    from fleetserve.engine.llm import LLM

    quantization = None if name in ("fp32", "bf16", "none") else name
    llm = LLM(model, dtype=args.dtype, device=args.device, quantization=quantization,
              max_model_len=max(len(prompt) + 2, args.input_len + args.steps + 4),
              max_num_seqs=max(args.batch_sizes), seed=args.seed,
              enable_prefix_caching=False)  # fmt: skip
    top1, own = _text_logprobs(llm, prompt)
    reference = top1 if baseline_top1 is None else baseline_top1
    agreement = sum(a == b for a, b in zip(top1, reference, strict=True)) / len(top1)
    from fleetserve.engine.worker.executor import UniProcExecutor

    executor = llm.engine_core.executor
    assert isinstance(executor, UniProcExecutor), "the quant bench runs one rank"
    runner = executor.worker.model_runner
    linear_mib, all_mib = _param_mib(runner.model)
    shapes = sorted({(m.output_size, m.input_size) for m in _linears(runner.model)})
    tps = {
        b: _decode_tokens_per_s(llm, b, args.steps, args.input_len, args.seed)
        for b in args.batch_sizes
    }
    llm.engine_core.shutdown()
    del llm, runner
    gc.collect()
    row = QuantRow(name, math.exp(-sum(own) / len(own)), agreement, linear_mib, all_mib, tps)
    return row, top1, shapes


def matmul_rows(shapes: list[tuple[int, int]], args: argparse.Namespace) -> list[str]:
    """Median µs of fp32 F.linear vs the two int8 paths on each projection shape."""
    import torch
    import torch.nn.functional as F

    from fleetserve.engine.quantization.int8 import dequantize_int8, quantize_int8_per_channel

    lines = [f"{'shape (out x in)':<18} {'batch':>5} {'F.linear':>10} {'int8 kernel':>12} "
             f"{'dequant':>10}  (µs, median)"]  # fmt: skip

    def median_us(fn: Any, reps: int = 30) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[reps // 2] * 1e6

    torch.manual_seed(args.seed)
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f)
        q, scale = quantize_int8_per_channel(w)
        for b in args.batch_sizes:
            x = torch.randn(b, in_f)
            fp = median_us(lambda: F.linear(x, w))  # noqa: B023 - timed at once
            kernel = median_us(lambda: torch._weight_int8pack_mm(x, q, scale))  # noqa: B023
            deq = median_us(lambda: F.linear(x, dequantize_int8(q, scale, x.dtype)))  # noqa: B023
            lines.append(f"{out_f:>7} x {in_f:<8} {b:>5} {fp:10.1f} {kernel:12.1f} {deq:10.1f}")
    return lines


def _linears(model: Any) -> list[Any]:
    from fleetserve.engine.layers.linear import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def format_table(rows: list[QuantRow], batch_sizes: list[int]) -> str:
    head = f"{'engine':<30} {'ppl':>8} {'top1 agree':>10} {'linear MiB':>11} {'all MiB':>8}"
    head += "".join(f" {f'tok/s b={b}':>11}" for b in batch_sizes)
    lines = [head]
    for r in rows:
        line = (f"{r.name:<30} {r.perplexity:8.3f} {100 * r.top1_agreement:9.1f}% "
                f"{r.linear_weight_mib:11.1f} {r.all_weight_mib:8.1f}")  # fmt: skip
        line += "".join(f" {r.tokens_per_s[b]:11.1f}" for b in batch_sizes)
        lines.append(line)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: bundled SmolLM2)")
    parser.add_argument("--engines", default="fp32,int8",
                        help="comma-separated; the first is the baseline: fp32 (unquantized in "
                        "--dtype) or a --quantization value")  # fmt: skip
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--batch-sizes", default="1,8", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch size")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--text", default=FIXED_TEXT, help="the text scored (default: fixed)")
    parser.add_argument("--matmul", action="store_true", help="also time the int8 matmul paths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def run_from_args(args: argparse.Namespace) -> int:
    from fleetserve.engine.models.bundled import bundled_model_path
    from fleetserve.engine.tokenizer import load_tokenizer

    model = args.model or str(bundled_model_path())
    prompt = list(load_tokenizer(model)(args.text)["input_ids"])
    rows: list[QuantRow] = []
    baseline: list[int] | None = None
    shapes: list[tuple[int, int]] = []
    for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        row, top1, shapes = run_engine(name, model, args, baseline, prompt)
        baseline = top1 if baseline is None else baseline
        rows.append(row)
    print(f"quant: {Path(model).name}, dtype {args.dtype}, {len(prompt)}-token fixed text, "
          f"{args.steps} decode steps")  # fmt: skip
    print(format_table(rows, args.batch_sizes))
    if args.matmul:
        print("\n".join(matmul_rows(shapes, args)))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
