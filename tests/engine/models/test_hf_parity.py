"""Our Llama/Qwen2 forward equals Hugging Face transformers on tiny random-weight checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.layers.attention.layer import attention_layers
from fleetserve.engine.layers.attention.metadata import build_attention_metadata
from fleetserve.engine.layers.forward_context import ForwardContext
from fleetserve.engine.models.registry import resolve_model_class
from fleetserve.engine.tokenizer import eos_token_ids
from tests.engine.tiny_models import load_engine_model, make_tiny_model

BLOCK_SIZE = 4
PROMPT = [5, 17, 300, 42, 9, 77, 128, 3, 250, 11, 64, 499, 7]


def _hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


def _kv_caches(model: Any, num_blocks: int) -> list[torch.Tensor]:
    attn = model.model.layers[0].self_attn
    shape = (2, num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_size)
    return [torch.zeros(shape) for _ in model.model.layers]


def _run_chunk(
    model: Any,
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    token_ids: list[int],
    start: int,
) -> torch.Tensor:
    """Compute tokens[start:] of one request whose first `start` tokens are cached."""
    positions = list(range(start, len(token_ids)))
    slots = [block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    metadata = build_attention_metadata(
        [len(positions)],
        [len(token_ids)],
        torch.tensor([block_ids], dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
        BLOCK_SIZE,
        torch.device("cpu"),
    )
    names = [layer.layer_name for layer in attention_layers(model)]
    context = ForwardContext(metadata, dict(zip(names, kv_caches, strict=True)))
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids[start:]), torch.tensor(positions), context)
        return model.compute_logits(hidden)


def _our_logits(model_dir: Path, token_ids: list[int], split: int = 0) -> torch.Tensor:
    config = EngineConfig.create(str(model_dir), dtype="float32", device="cpu")
    model: Any = load_engine_model(config)
    kv_caches = _kv_caches(model, num_blocks=8)
    block_ids = [3, 1, 6, 2]  # NOTE: scattered on purpose, the table (not order) must rule
    if split == 0:
        return _run_chunk(model, kv_caches, block_ids, token_ids, 0)
    first = _run_chunk(model, kv_caches, block_ids, token_ids[:split], 0)
    second = _run_chunk(model, kv_caches, block_ids, token_ids, split)
    return torch.cat([first, second])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_full_prompt_logits_match_hf(arch: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    ours = _our_logits(model_dir, PROMPT)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, _hf_logits(model_dir, PROMPT), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_logits_match_single_pass(tiny_qwen2_dir: Path) -> None:
    torch.testing.assert_close(
        _our_logits(tiny_qwen2_dir, PROMPT, split=6),
        _our_logits(tiny_qwen2_dir, PROMPT),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
                "rope_theta": 500000.0,
            },
        ),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        (
            "qwen2",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": True}),
    ],
    ids=["llama3-rope", "linear-rope", "yarn-rope", "llama-tied", "qwen2-tied"],
)
def test_variants_match_hf(tmp_path: Path, arch: str, overrides: dict[str, object]) -> None:
    model_dir = make_tiny_model(tmp_path, arch, seed=1, **overrides)
    ours = _our_logits(model_dir, PROMPT)
    torch.testing.assert_close(ours, _hf_logits(model_dir, PROMPT), rtol=1e-4, atol=1e-4)


def test_tied_checkpoint_has_no_lm_head_and_loads_tied(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    model: Any = load_engine_model(
        EngineConfig.create(str(model_dir), dtype="float32", device="cpu")
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bfloat16_load_casts_every_parameter(tiny_llama_dir: Path) -> None:
    config = EngineConfig.create(str(tiny_llama_dir), dtype="bfloat16", device="cpu")
    model = load_engine_model(config)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = _run_chunk(
        model, [c.bfloat16() for c in _kv_caches(model, 8)], [3, 1, 6, 2], PROMPT, 0
    )
    reference = _our_logits(tiny_llama_dir, PROMPT)
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*Qwen2ForCausalLM"):
        resolve_model_class("GPT2LMHeadModel")


def test_eos_ids_from_generation_config(tiny_llama_dir: Path) -> None:
    assert eos_token_ids(tiny_llama_dir, {"eos_token_id": [7, 8]}) == (2,)
    assert eos_token_ids(tiny_llama_dir / "missing", {"eos_token_id": [7, 8]}) == (7, 8)
