"""The seed's quantization config-resolution scenarios (notes part 3 §4, Q1–Q5) and the engine's
resolution against the checkpoint (no torch model is built here)."""

from __future__ import annotations

import pytest

from fleetserve.engine.quantization.config import (
    LayerPattern,
    QuantizationConfigArgs,
    QuantSpec,
    resolve_quantization_config,
    select_online_spec,
)
from fleetserve.engine.quantization.keys import (
    QuantKey,
    coerce_quant_key,
    kFp8DynamicTensorSym,
    kFp8StaticTensorSym,
    kInt8StaticChannelSym,
    kMxfp4Static,
)
from fleetserve.engine.quantization.resolve import resolve_engine_quantization

CT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 32},
            "input_activations": None,
        }
    },
    "ignore": ["lm_head"],
}  # fmt: skip


def test_q1_fp8_shorthand_is_static_per_tensor_for_linear_and_moe_and_awq_defers() -> None:
    args = resolve_quantization_config("fp8_per_tensor", None)
    assert args is not None
    assert args.linear.weight == kFp8StaticTensorSym
    assert args.moe.weight == kFp8StaticTensorSym
    assert str(args.linear) == "fp8_per_tensor_static"
    assert resolve_quantization_config("awq", None) is None


def test_q2_deferred_mxfp4_yields_to_checkpoint_metadata() -> None:
    assert resolve_quantization_config("mxfp4", None) is None
    online = select_online_spec("mxfp4", None, checkpoint_method=None)
    assert online is not None and online.linear.weight == kMxfp4Static
    assert select_online_spec("mxfp4", None, checkpoint_method="compressed-tensors") is None
    # The engine: with metadata the checkpoint's method loads; without, online mxfp4 is refused
    # (not built) rather than silently serving full precision.
    quant = resolve_engine_quantization("mxfp4", None, {"quantization_config": CT_CONFIG})
    assert quant is not None and quant.name == "compressed-tensors"
    with pytest.raises(ValueError, match="no online method"):
        resolve_engine_quantization("mxfp4", None, {})


def test_q3_or_merge_keeps_the_shorthand_linear_and_empty_ignore_inherits() -> None:
    base = resolve_quantization_config("fp8_per_tensor", None)
    assert base is not None
    merged = resolve_quantization_config(
        "fp8_per_tensor", {"moe": {"activation": "fp8_per_tensor_dynamic"}, "ignore": []}
    )
    assert merged is not None
    assert merged.linear == base.linear
    assert merged.moe == QuantSpec(None, kFp8DynamicTensorSym)
    assert merged.ignore == base.ignore == ()
    with_ignore = resolve_quantization_config("int8", {"ignore": ["lm_head"], "linear": {}})
    assert with_ignore is not None
    assert with_ignore.linear.weight == kInt8StaticChannelSym  # an empty spec inherits
    assert [p.text for p in with_ignore.ignore] == ["lm_head"]


def test_q4_targets_exclusive_with_linear_shorthand_field_and_single_key() -> None:
    with pytest.raises(ValueError, match="targets is exclusive"):
        QuantizationConfigArgs.from_dict(
            {"targets": {"x": "int8_per_channel_static"}, "linear": "fp8_per_tensor"}
        )
    with pytest.raises(ValueError, match="has no moe spec"):
        QuantizationConfigArgs.from_dict({"moe": "int8_per_channel_weight_only"})
    # A shorthand name takes that field's spec; a key name is that one key (the weight).
    shorthand = QuantizationConfigArgs.from_dict({"linear": "fp8_per_tensor"})
    assert shorthand.linear == QuantSpec(kFp8StaticTensorSym, kFp8DynamicTensorSym)
    key = QuantizationConfigArgs.from_dict({"linear": "fp8_per_tensor_static"})
    assert key.linear == QuantSpec(kFp8StaticTensorSym, None)


def test_q5_bad_regex_raises_naming_it_and_globs_match() -> None:
    with pytest.raises(ValueError, match=r"invalid regex 're:\[\('"):
        QuantizationConfigArgs.from_dict({"targets": {"re:[(": "int8_per_channel_static"}})
    glob = LayerPattern.parse("model.layers.*.mlp.*", field_name="ignore")
    assert glob.matches("model.layers.3.mlp.down_proj")
    assert not glob.matches("model.layers.3.self_attn.o_proj")
    regex = LayerPattern.parse(r"re:.*\.(q|k)_proj", field_name="ignore")
    assert regex.matches("model.layers.0.self_attn.k_proj")
    assert not regex.matches("model.layers.0.self_attn.v_proj")
    exact = LayerPattern.parse("model.layers.0.mlp.down_proj", field_name="ignore")
    assert exact.is_exact and not exact.matches("model.layers.10.mlp.down_proj")


def test_quant_key_names_and_objects_coerce_to_the_same_key() -> None:
    assert coerce_quant_key("int8_per_channel_static", field="f") == kInt8StaticChannelSym
    assert coerce_quant_key(kInt8StaticChannelSym, field="f") is kInt8StaticChannelSym
    assert coerce_quant_key(list(kFp8StaticTensorSym), field="f") == kFp8StaticTensorSym
    assert isinstance(coerce_quant_key(["int8", [1, -1], True], field="f"), QuantKey)
    with pytest.raises(ValueError, match="linear must be one of"):
        coerce_quant_key("int9", field="linear")
    assert str(QuantSpec()) == "unset"


def test_engine_resolution_against_the_checkpoint() -> None:
    assert resolve_engine_quantization(None, None, {}) is None
    online = resolve_engine_quantization("int8", None, {})
    assert online is not None and online.online is not None and online.checkpoint is None
    ckpt = resolve_engine_quantization(None, None, {"quantization_config": CT_CONFIG})
    assert ckpt is not None and ckpt.checkpoint is not None
    assert (ckpt.checkpoint.num_bits, ckpt.checkpoint.group_size) == (4, 32)
    with pytest.raises(ValueError, match="already quantized"):
        resolve_engine_quantization("int8", None, {"quantization_config": CT_CONFIG})
    with pytest.raises(ValueError, match="has no quantization_config"):
        resolve_engine_quantization("compressed-tensors", None, {})
    with pytest.raises(ValueError, match="quant_method must be one of"):
        resolve_engine_quantization(None, None, {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_engine_quantization("int3", None, {})
    with pytest.raises(ValueError, match="needs quantization_config"):
        resolve_engine_quantization("online", None, {})
    with pytest.raises(ValueError, match="MoE expert quantization"):
        resolve_engine_quantization("fp8", None, {"num_local_experts": 8})
    asym = {**CT_CONFIG, "config_groups": {"g": {**CT_CONFIG["config_groups"]["group_0"],  # type: ignore[index]
            "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                        "group_size": 32}}}}  # fmt: skip
    with pytest.raises(ValueError, match=r"weights.symmetric must be one of \(True,\)"):
        resolve_engine_quantization(None, None, {"quantization_config": asym})
