"""MoE models through the engine: greedy token ids equal transformers' exactly (float32), with
chunked prefill and preemption active; over two gloo worker processes (the 'mp' executor),
expert parallel (EP group = TP group: experts spread, hidden states replicated, one all-reduce)
and plain tensor parallel (every expert split like an MLP) give the same tokens as one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.engine.worker.multiproc_executor import MultiprocExecutor
from tests.engine.tiny_models import hf_greedy, make_prompts, make_tiny_moe_model

MAX_TOKENS = 8
LENGTHS = [5, 17, 33, 8, 40, 21]
# Chunks of at most 16 tokens per step (8 per prompt) and 10 blocks of 8 tokens for six
# prompts of up to 48 tokens: long prompts are chunked and requests get preempted.
SETTINGS = {
    "dtype": "float32",
    "device": "cpu",
    "max_model_len": 128,
    "block_size": 8,
    "num_kv_blocks": 10,
    "max_num_batched_tokens": 16,
    "long_prefill_token_threshold": 8,
    "enable_prefix_caching": False,
}
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
}  # fmt: skip
# Model variants: (architecture, config overrides). The YaRN variant checks MLA's mscale²
# softmax scale and the non-interleaved RoPE layout.
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-yarn": ("deepseek_v3", {"rope_parameters": YARN, "rope_interleave": False}),
}
ARCHS = sorted(VARIANTS)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        name: make_tiny_moe_model(root / name, arch, **overrides)
        for name, (arch, overrides) in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(512, LENGTHS, seed=3)


@pytest.fixture(scope="module")
def expected(moe_dirs: dict[str, Path], prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy(path, prompts, MAX_TOKENS) for arch, path in moe_dirs.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_model_matches_transformers(
    arch: str,
    moe_dirs: dict[str, Path],
    prompts: list[list[int]],
    expected: dict[str, list[list[int]]],
) -> None:
    llm = LLM(str(moe_dirs[arch]), **SETTINGS)
    try:
        assert _generate(llm, prompts) == expected[arch]
        assert llm.engine_core.make_stats().num_preemptions > 0, "the cache should preempt"
        model = llm.engine_core.executor.worker.model_runner.model
        layers = model.moe_layers()
        assert layers and all(
            m.ep_size == 1 and m.num_local_physical_experts == m.num_logical_experts for m in layers
        )
    finally:
        llm.engine_core.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_expert_parallel_2_equals_1(
    arch: str,
    moe_dirs: dict[str, Path],
    prompts: list[list[int]],
    expected: dict[str, list[list[int]]],
) -> None:
    llm = LLM(
        str(moe_dirs[arch]),
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        distributed_executor_backend="mp",
        **SETTINGS,
    )
    try:
        executor = llm.engine_core.executor
        assert isinstance(executor, MultiprocExecutor)
        # Each rank holds half of every MoE layer's experts: rank 0 the first half.
        slots = executor.collective_rpc("moe_expert_slots")
        num_experts = 4 if arch == "mixtral" else 8
        assert slots[0] and all(s == list(range(num_experts // 2)) for s in slots[0])
        assert all(s == list(range(num_experts // 2, num_experts)) for s in slots[1])
        assert _generate(llm, prompts) == expected[arch]
    finally:
        llm.engine_core.shutdown()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_bfloat16_moe_block_is_bit_identical_to_transformers(
    arch: str, moe_dirs: dict[str, Path]
) -> None:
    """Routing, expert GEMMs, the float32 combine (Qwen's weights rounded to bfloat16 first)
    and the shared expert: the same bits as transformers' MoE block in bfloat16."""
    from transformers import AutoModelForCausalLM

    from fleetserve.engine.arg_utils import EngineArgs
    from tests.engine.tiny_models import load_engine_model

    path = moe_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    config = EngineArgs(
        model=str(path), dtype="bfloat16", device="cpu", max_model_len=128
    ).create_engine_config()
    ours = load_engine_model(config)
    layer = 2 if arch in ("qwen2_moe", "deepseek_v3") else 1  # an MoE layer
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        expected = hf.model.layers[layer].mlp(x)
        got = ours.model.layers[layer].mlp(x[0])
    assert torch.equal(got, expected[0])
