"""`fleetserve bench spec-decode`: output tokens/s with and without speculative decoding.

Two workloads through the same engine settings, each run twice (plain, then with the proposer),
EOS ignored so both runs produce the same number of tokens:

- `repetitive`: chat requests that make the model quote its prompt (edit a piece of code, correct
  a passage), greedy: what prompt lookup is for; the speculative run's tokens must equal the
  plain run's;
- `random`: random token-id prompts, sampled at temperature `--random-temperature` (seeded per
  request), so the text does not repeat either (greedy decoding of a small model soon loops,
  which prompt lookup would predict perfectly and flatter the figure).

Both engines stay loaded and run alternately `--repeats` times (the box is shared and noisy);
the median run of each is printed: tokens/s side by side, the speedup, the acceptance rate and
the mean tokens per verified draft.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

_CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    result = []
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index + 1 >= window:
            result.append(total / window)
    return result
"""
_PASSAGE = (
    "The river rises in the northern hills and flows south for three hundred kilometres. "
    "Along its banks lie several old towns, each with a stone bridge and a market square. "
    "In spring the water is high and fast; in late summer it is slow and warm, and children "
    "swim in the shallow bends below the mills. Fishermen say the best catches come in autumn."
)
REPETITIVE_TASKS = (
    f"Rename the variable `total` to `running_sum` in this code and return the whole code:\n\n"
    f"{_CODE}",
    f"Rewrite this function with type hints, keeping everything else the same:\n\n{_CODE}",
    f"Repeat the following passage exactly, replacing 'river' with 'stream':\n\n{_PASSAGE}",
    f"Copy this text and fix nothing, just repeat it word for word:\n\n{_PASSAGE}",
)


@dataclass(frozen=True, slots=True)
class RunResult:
    workload: str
    engine: str
    seconds: float
    output_tokens: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_draft(self) -> float:
        """Tokens a verified draft yields: its accepted tokens plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: bundled SmolLM2)")
    parser.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    parser.add_argument("--draft-model", default=None, help="draft_model: the draft's folder")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--workload", default="both", choices=["both", "repetitive", "random"])
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per workload")
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-temperature", type=float, default=1.0)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; median shown")
    parser.add_argument("--output-json", default=None, help="write the results here")


def _speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
    if args.draft_model is None:
        raise SystemExit("--method draft_model needs --draft-model PATH")
    return {
        "method": "draft_model",
        "model": args.draft_model,
        "num_speculative_tokens": args.num_speculative_tokens,
    }


def _prompts(llm: Any, workload: str, args: argparse.Namespace) -> list[list[int]]:
    from fleetserve.engine.chat import apply_chat_template

    if workload == "repetitive":
        tasks = [REPETITIVE_TASKS[i % len(REPETITIVE_TASKS)] for i in range(args.num_prompts)]
        return [
            apply_chat_template(llm.tokenizer, [{"role": "user", "content": task}])
            for task in tasks
        ]
    rng = random.Random(args.seed)
    vocab = llm.engine_core.config.model.vocab_size
    return [
        [rng.randrange(100, vocab) for _ in range(args.random_input_len)]
        for _ in range(args.num_prompts)
    ]


class _Engine:
    """One engine (plain or speculative) loaded once and run over a workload repeatedly."""

    def __init__(
        self, workload: str, spec: dict[str, Any] | None, args: argparse.Namespace
    ) -> None:
        from fleetserve import LLM, SamplingParams

        self.workload = workload
        self.name = (
            "plain" if spec is None else f"{spec['method']} k={spec['num_speculative_tokens']}"
        )
        self.llm = LLM(
            args.model,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            attention_backend=args.attention_backend,
            speculative_config=spec,
        )
        self.prompts = _prompts(self.llm, workload, args)
        greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.params = [greedy] * len(self.prompts)
        if workload == "random":
            self.params = [
                greedy.clone(temperature=args.random_temperature, seed=args.seed + i)
                for i in range(len(self.prompts))
            ]
        warm_up = [{"prompt_token_ids": self.prompts[0][:16]}]
        self.llm.generate(warm_up, greedy.clone(max_tokens=4))

    def run(self) -> tuple[RunResult, list[list[int]]]:
        core = self.llm.engine_core
        # NOTE: every repeat computes its prompts again (no hits from the previous repeat).
        core.reset_prefix_cache()
        before = core.make_stats().spec_decoding
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in self.prompts], self.params)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outputs]
        after = core.make_stats().spec_decoding
        counts: dict[str, int] = {}
        if before is not None and after is not None:
            counts = {
                "num_draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
                "num_accepted_tokens": after.num_accepted_tokens - before.num_accepted_tokens,
                "num_drafts": after.num_drafts - before.num_drafts,
            }
        result = RunResult(self.workload, self.name, seconds, sum(map(len, tokens)), **counts)
        return result, tokens


def _median_run(runs: list[RunResult]) -> RunResult:
    """The run of median duration (the box is shared: repeats alternate the two engines)."""
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def run_from_args(args: argparse.Namespace) -> int:
    spec = _speculative_config(args)
    workloads = ["repetitive", "random"] if args.workload == "both" else [args.workload]
    results: list[RunResult] = []
    identical: dict[str, bool] = {}
    for workload in workloads:
        engines = [_Engine(workload, None, args), _Engine(workload, spec, args)]
        runs: list[list[RunResult]] = [[], []]
        tokens: list[list[list[int]]] = [[], []]
        for _ in range(args.repeats):
            for index, engine in enumerate(engines):
                result, tokens[index] = engine.run()
                runs[index].append(result)
        results += [_median_run(runs[0]), _median_run(runs[1])]
        if workload == "repetitive":
            identical[workload] = tokens[0] == tokens[1]
        del engines
    print(format_table(results, identical))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0 if all(identical.values()) else 1


def format_table(results: list[RunResult], identical: dict[str, bool]) -> str:
    """One line per run; `identical`: workload → the greedy runs' tokens matched (sampled
    workloads are absent: their tokens differ by design, their distribution does not)."""
    lines = [
        f"{'workload':<11} {'engine':<16} {'tok/s':>8} {'speedup':>8} {'accept':>7} "
        f"{'tok/draft':>9} {'same tokens':>11}"
    ]
    plain_rate: dict[str, float] = {}
    for r in results:
        if r.engine == "plain":
            plain_rate[r.workload] = r.tokens_per_s
        speedup = r.tokens_per_s / plain_rate[r.workload] if r.workload in plain_rate else 1.0
        accept = f"{100 * r.acceptance_rate:.1f}%" if r.engine != "plain" else "-"
        per_draft = f"{r.tokens_per_draft:.2f}" if r.engine != "plain" else "-"
        same = "-"
        if r.engine != "plain":
            matched = identical.get(r.workload)
            same = "sampled" if matched is None else ("yes" if matched else "NO")
        lines.append(
            f"{r.workload:<11} {r.engine:<16} {r.tokens_per_s:>8.1f} {speedup:>7.2f}x "
            f"{accept:>7} {per_draft:>9} {same:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
