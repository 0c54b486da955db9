"""`ModelArch`: typed fields from config.json, clear errors naming the key, the refusals the
model classes keep, and the per-model weight mapping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.layers.rotary import RopeSettings
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.llama import LlamaForCausalLM
from fleetserve.engine.models.qwen2 import Qwen2ForCausalLM
from tests.engine.tiny_models import TINY_CONFIG, load_engine_model, make_tiny_model


def _config(**overrides: Any) -> dict[str, Any]:
    config = {"architectures": ["LlamaForCausalLM"], **TINY_CONFIG, **overrides}
    return {k: v for k, v in config.items() if v is not None}


def test_fields_are_typed_and_derived_once() -> None:
    arch = ModelArch.from_hf_config(_config())
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.hidden_size, arch.num_hidden_layers, arch.intermediate_size) == (64, 2, 128)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_size) == (4, 2, 32)
    assert (arch.q_size, arch.kv_size, arch.vocab_size) == (128, 64, 512)
    assert arch.rms_norm_eps == 1e-6 and arch.max_position_embeddings == 256
    assert arch.hidden_act == "silu" and not arch.tie_word_embeddings
    assert not arch.attention_bias and not arch.mlp_bias
    assert arch.sliding_window is None and arch.use_sliding_window is None
    assert arch.rope == RopeSettings(rope_theta=10000.0, max_position_embeddings=256)


def test_defaults_follow_the_hf_conventions() -> None:
    arch = ModelArch.from_hf_config(
        _config(head_dim=None, num_key_value_heads=None, rms_norm_eps=None, hidden_act=None)
    )
    assert arch.head_size == 64 // 4 and arch.num_key_value_heads == 4
    assert arch.rms_norm_eps == 1e-6 and arch.hidden_act == "silu"
    assert ModelArch.from_hf_config(_config(architectures=None)).architecture == "?"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": None}, "config.json must set 'hidden_size'"),
        ({"vocab_size": "512"}, "config.json 'vocab_size' must be an integer >= 1, got '512'"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be an integer >= 1, got 0"),
        ({"intermediate_size": 12.5}, "'intermediate_size' must be an integer >= 1, got 12.5"),
        ({"rms_norm_eps": "tiny"}, "config.json 'rms_norm_eps' must be a number"),
        ({"num_key_value_heads": 3}, r"'num_attention_heads' \(4\) must be a multiple of"),
        ({"hidden_act": ["silu"]}, "'hidden_act' must be a string"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
        ({"head_dim": None, "hidden_size": 66}, "'hidden_size' \\(66\\) must be a multiple"),
    ],
)
def test_a_missing_or_bad_key_is_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config(_config(**overrides))


def test_legacy_and_v5_rope_keys_give_the_same_settings() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    scaling |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    legacy = ModelArch.from_hf_config(_config(rope_scaling=scaling, rope_theta=500000.0))
    v5 = ModelArch.from_hf_config(_config(rope_parameters={**scaling, "rope_theta": 500000.0}))
    assert legacy.rope == v5.rope
    assert legacy.rope.rope_type == "llama3" and legacy.rope.rope_theta == 500000.0
    old_style = ModelArch.from_hf_config(_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert (old_style.rope.rope_type, old_style.rope.factor) == ("linear", 2.0)
    yarn = ModelArch.from_hf_config(_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert yarn.rope.original_max_position_embeddings == 256  # max_position_embeddings


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        (
            {"rope_type": "dynamic", "factor": 2.0},
            r"rope_scaling.rope_type must be one of \('default', 'linear', 'llama3', 'yarn'\), "
            "got 'dynamic'",
        ),
        ({"rope_type": "linear"}, "rope_scaling.factor is required for rope_type 'linear'"),
        (
            {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
            "rope_scaling.low_freq_factor is required for rope_type 'llama3'",
        ),
        ({"rope_type": "linear", "factor": "2"}, "rope_scaling.'factor' must be a number"),
    ],
)
def test_unsupported_or_incomplete_rope_is_refused(scaling: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config(_config(rope_scaling=scaling))


def _edited(folder: Path, **changes: Any) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def _load(folder: Path, max_model_len: int = 64) -> Any:
    config = EngineConfig.create(
        str(folder), dtype="float32", device="cpu", max_model_len=max_model_len
    )
    return load_engine_model(config)


def test_the_model_classes_keep_their_refusals(tmp_path: Path) -> None:
    llama = make_tiny_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="hidden_act must be 'silu', got 'gelu'"):
        _load(_edited(llama, hidden_act="gelu"))
    _edited(llama, hidden_act="silu", sliding_window=32)
    with pytest.raises(
        ValueError,
        match=r"sliding_window attention is not supported; max_model_len must be <= "
        r"sliding_window \(32\), got 64",
    ):
        _load(llama)
    assert _load(llama, max_model_len=32) is not None  # the window covers every sequence
    assert _load(_edited(llama, use_sliding_window=False)) is not None
    # Qwen2 applies a window only when the config switches it on.
    qwen2 = _edited(make_tiny_model(tmp_path, "qwen2"), sliding_window=32)
    assert (
        ModelArch.from_hf_config(json.loads((qwen2 / "config.json").read_text())).use_sliding_window
        is False
    )
    assert _load(qwen2) is not None
    with pytest.raises(ValueError, match="sliding_window attention is not supported"):
        _load(_edited(qwen2, use_sliding_window=True))


def test_the_weight_mapping_is_the_model_classs_own() -> None:
    mapping = LlamaForCausalLM.stacked_params_mapping()
    assert [m for m in mapping if m[1] == "qkv_proj"] == [
        ("q_proj", "qkv_proj", 0),
        ("k_proj", "qkv_proj", 1),
        ("v_proj", "qkv_proj", 2),
    ]
    assert Qwen2ForCausalLM.stacked_params_mapping() == mapping
    arch = ModelArch.from_hf_config(_config(attention_bias=True, mlp_bias=True))
    assert LlamaForCausalLM.projection_biases(arch) == (True, True, True)
    assert Qwen2ForCausalLM.projection_biases(arch) == (True, False, False)
