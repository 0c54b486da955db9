"""The MoE config view: which layers are MoE, what each family's keys mean, what is refused;
and the registry runs every architecture the view calls MoE."""

from __future__ import annotations

import pytest

from fleetserve.engine.models.moe_arch import MOE_ARCHITECTURES, MoeArch, is_moe_config
from fleetserve.engine.models.registry import supported_architectures


def test_every_moe_architecture_is_registered() -> None:
    assert set(MOE_ARCHITECTURES) <= set(supported_architectures())
    assert is_moe_config({"architectures": ["MixtralForCausalLM"]})
    assert not is_moe_config({"architectures": ["LlamaForCausalLM"]})


def test_qwen2_moe_dense_layers_and_shared_expert() -> None:
    moe = MoeArch.from_hf_config({
        "architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 6, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 2,
        "mlp_only_layers": [3], "shared_expert_intermediate_size": 32,
    })  # fmt: skip
    assert [moe.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert (moe.renormalize, moe.shared_expert_intermediate_size, moe.shared_expert_gate) == (
        False, 32, True,
    )  # fmt: skip


def test_deepseek_v3_routing_and_dense_first_layers() -> None:
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "n_shared_experts": 2, "first_k_dense_replace": 1,
        "norm_topk_prob": True,
    }  # fmt: skip
    moe = MoeArch.from_hf_config(config)
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert (moe.scoring_func, moe.use_correction_bias, moe.num_expert_groups) == (
        "sigmoid",
        True,
        4,
    )
    assert (moe.shared_expert_intermediate_size, moe.routed_scaling_factor) == (32, 2.5)
    with pytest.raises(ValueError, match="'scoring_func' must be 'sigmoid'"):
        MoeArch.from_hf_config({**config, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="'topk_method' must be 'noaux_tc'"):
        MoeArch.from_hf_config({**config, "topk_method": "greedy"})


def test_bad_or_missing_keys_are_named() -> None:
    with pytest.raises(ValueError, match="must set 'num_local_experts'"):
        MoeArch.from_hf_config(
            {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2,
             "num_experts_per_tok": 2, "intermediate_size": 8}
        )  # fmt: skip
    with pytest.raises(ValueError, match="'num_experts_per_tok' must be in \\[1, 4\\]"):
        MoeArch.from_hf_config(
            {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2,
             "num_experts_per_tok": 5, "num_local_experts": 4, "intermediate_size": 8}
        )  # fmt: skip
    with pytest.raises(ValueError, match="must be one of the MoE models"):
        MoeArch.from_hf_config({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                                "num_experts_per_tok": 1})  # fmt: skip
