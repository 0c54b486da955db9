"""`MoeArch`: the mixture-of-experts part of a config.json, typed and validated (torch-free).

Each MoE family names its keys differently (Mixtral `num_local_experts`, Qwen `num_experts` and
`moe_intermediate_size`, DeepSeek `n_routed_experts`, `n_group`, ...); this view reads them once,
by architecture, so the models and the engine arguments (`is_moe_config`: expert parallelism is
for MoE models only) agree on which models are MoE and how they route.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MOE_ARCHITECTURES", "MoeArch", "is_moe_config"]

MOE_ARCHITECTURES: frozenset[str] = frozenset(
    {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"}
)


def is_moe_config(hf_config: Mapping[str, Any]) -> bool:
    """Whether config.json's `architectures[0]` is one of the MoE models this engine runs."""
    archs = hf_config.get("architectures") or ["?"]
    return str(archs[0]) in MOE_ARCHITECTURES


def _int(config: Mapping[str, Any], keys: tuple[str, ...], default: int | None = None) -> int:
    """The first of `keys` present, as an int >= 0 (the message names them)."""
    for key in keys:
        value = config.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
                raise ValueError(f"config.json {key!r} must be an integer, got {value!r}")
            if value < 0:
                raise ValueError(f"config.json {key!r} must be >= 0, got {value!r}")
            return int(value)
    if default is None:
        raise ValueError(f"config.json must set {' or '.join(repr(k) for k in keys)}")
    return default


@dataclass(frozen=True, slots=True)
class MoeArch:
    """How a model's MoE layers are built and route (from config.json)."""

    num_experts: int
    """Routed (logical) experts per MoE layer."""
    top_k: int
    """`num_experts_per_tok`."""
    moe_intermediate_size: int
    """Each routed expert's intermediate width."""
    renormalize: bool
    """Renormalise the top-k weights (Mixtral: always; Qwen and DeepSeek: `norm_topk_prob`)."""
    scoring_func: str = "softmax"
    """'softmax', or 'sigmoid' for DeepSeek-V3."""
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = False
    """DeepSeek-V3's `e_score_correction_bias` (noaux_tc routing)."""
    shared_expert_intermediate_size: int = 0
    """The shared expert's width (0: none)."""
    weights_in_logits_dtype: bool = False
    """Qwen: the routing weights are rounded to the activation dtype."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: the shared expert's output is scaled by sigmoid(a [1, H] gate)."""
    moe_layers: tuple[bool, ...] = ()
    """Per decoder layer, whether it has routed experts (else a dense MLP of
    `intermediate_size`): Qwen's `decoder_sparse_step` and `mlp_only_layers`, DeepSeek's
    `first_k_dense_replace` and `moe_layer_freq`; empty: every layer."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(
                f"config.json: the number of experts must be >= 1, got {self.num_experts}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"config.json 'num_experts_per_tok' must be in [1, {self.num_experts}], "
                f"got {self.top_k}"
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has routed experts (else a dense MLP)."""
        return not self.moe_layers or self.moe_layers[index]

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> MoeArch:
        """Read the MoE settings of a supported MoE architecture.

        Raises:
            ValueError: not a supported MoE architecture, or a key missing or malformed (the
                message names it).
        """
        archs = hf_config.get("architectures") or ["?"]
        arch = str(archs[0])
        top_k = _int(hf_config, ("num_experts_per_tok",))
        layers = range(_int(hf_config, ("num_hidden_layers",)))
        norm = bool(hf_config.get("norm_topk_prob", False))
        if arch == "MixtralForCausalLM":
            return cls(
                num_experts=_int(hf_config, ("num_local_experts",)),
                top_k=top_k,
                moe_intermediate_size=_int(hf_config, ("intermediate_size",)),
                renormalize=True,
            )
        if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            shared = _int(hf_config, ("shared_expert_intermediate_size",), 0)
            step = _int(hf_config, ("decoder_sparse_step",), 1)
            dense_only = {int(i) for i in hf_config.get("mlp_only_layers") or ()}
            return cls(
                num_experts=_int(hf_config, ("num_experts", "num_local_experts")),
                top_k=top_k,
                moe_intermediate_size=_int(hf_config, ("moe_intermediate_size",)),
                renormalize=norm,
                shared_expert_intermediate_size=shared if arch == "Qwen2MoeForCausalLM" else 0,
                shared_expert_gate=arch == "Qwen2MoeForCausalLM" and shared > 0,
                weights_in_logits_dtype=True,
                moe_layers=tuple(
                    i not in dense_only and (i + 1) % max(1, step) == 0 for i in layers
                ),
            )
        if arch == "DeepseekV3ForCausalLM":
            scoring = str(hf_config.get("scoring_func", "sigmoid"))
            if scoring != "sigmoid":
                raise ValueError(f"config.json 'scoring_func' must be 'sigmoid', got {scoring!r}")
            method = str(hf_config.get("topk_method", "noaux_tc"))
            if method != "noaux_tc":
                raise ValueError(f"config.json 'topk_method' must be 'noaux_tc', got {method!r}")
            moe_inter = _int(hf_config, ("moe_intermediate_size",))
            first_dense = _int(hf_config, ("first_k_dense_replace",), 0)
            freq = max(1, _int(hf_config, ("moe_layer_freq",), 1))
            factor = hf_config.get("routed_scaling_factor", 1.0)
            if isinstance(factor, bool) or not isinstance(factor, int | float):
                raise ValueError(
                    f"config.json 'routed_scaling_factor' must be a number, got {factor!r}"
                )
            return cls(
                num_experts=_int(hf_config, ("n_routed_experts",)),
                top_k=top_k,
                moe_intermediate_size=moe_inter,
                renormalize=norm,
                scoring_func="sigmoid",
                num_expert_groups=_int(hf_config, ("n_group",), 1),
                topk_groups=_int(hf_config, ("topk_group",), 1),
                routed_scaling_factor=float(factor),
                use_correction_bias=True,
                shared_expert_intermediate_size=moe_inter
                * _int(hf_config, ("n_shared_experts",), 1),
                moe_layers=tuple(i >= first_dense and i % freq == 0 for i in layers),
            )
        raise ValueError(
            f"architectures[0] must be one of the MoE models {sorted(MOE_ARCHITECTURES)}, "
            f"got {arch!r}"
        )
