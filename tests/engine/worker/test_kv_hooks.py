"""The runner's side of the per-layer KV hooks: passed in the step's forward context, called per
layer per step, and a step with hooks never replays (or pads for) a decode graph."""

from __future__ import annotations

from pathlib import Path

import torch

from fleetserve import LLM, SamplingParams
from fleetserve.engine.layers.attention.metadata import AttentionMetadata
from fleetserve.engine.worker.cuda_graphs import DecodeGraphs
from fleetserve.engine.worker.executor import UniProcExecutor
from fleetserve.engine.worker.model_runner import ModelRunner

PROMPTS = [{"prompt_token_ids": [3 + i, 17, 90 + 7 * i] * (1 + i)} for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class CountingHooks:
    def __init__(self) -> None:
        self.loads: list[str] = []
        self.saves: list[str] = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.loads.append(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        self.saves.append(layer_name)


def _llm(path: Path) -> LLM:
    return LLM(
        str(path), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=4
    )


def _runner(llm: LLM) -> ModelRunner:
    executor = llm.engine_core.executor
    assert isinstance(executor, UniProcExecutor)
    return executor.worker.model_runner


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def test_steps_with_hooks_run_eagerly_and_call_every_layer(tiny_llama_dir: Path) -> None:
    plain = _llm(tiny_llama_dir)
    expected = _tokens(plain)
    # Without hooks, a (non-capturing) decode-graph set pads and "replays" decode steps ...
    graphs = DecodeGraphs((1, 2, 4), capture=False)
    _runner(plain).decode_graphs = graphs
    assert _tokens(plain) == expected and graphs.num_runs > 0
    # ... with hooks, no step goes near the graphs, and every layer is hooked every step.
    llm = _llm(tiny_llama_dir)
    runner = _runner(llm)
    graphs = DecodeGraphs((1, 2, 4), capture=False)
    runner.decode_graphs = graphs
    hooks = CountingHooks()
    runner.kv_hooks = hooks
    assert _tokens(llm) == expected
    assert graphs.num_runs == 0
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    num_steps = len(hooks.loads) // len(names)
    assert num_steps >= 5  # the prefill plus at least four decode steps
    assert hooks.loads == names * num_steps
    assert hooks.saves == names * num_steps
