"""What every MoE model family shares: the sparse MoE block and the MoE weight loading.

`SparseMoeBlock` is one layer's MLP: a replicated router (`gate`, [E, H]), the routed experts
(`FusedMoE`, which routes, computes and sums over its ranks) and, for Qwen2-MoE and DeepSeek, a
shared expert (a dense, tensor-parallel MLP every token goes through; Qwen2-MoE scales it by
sigmoid(`shared_expert_gate`)); its partial sum joins the routed experts' in their one
all-reduce. `MoeModelMixin` gives a Llama-based model `moe_layers()` and
streams the checkpoint's per-expert tensors (`...experts.<id>.<w1|w2|w3|gate_proj|up_proj|
down_proj>.weight`) into the `FusedMoE` slots that hold that expert on this rank, so a rank
reads only the experts it keeps; every other tensor goes to the dense loader.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.engine.layers.fused_moe import FusedMoE, RoutingConfig
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import CheckpointTensor, Linear
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.llama import LlamaMLP
from fleetserve.engine.models.moe_arch import MoeArch

__all__ = ["MoeModelMixin", "SparseMoeBlock", "routing_config"]

_EXPERT_TENSOR = re.compile(
    r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)"
    r"\.weight$"
)
_PART_OF = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down"}
_PART_OF["down_proj"] = "down"


def routing_config(moe: MoeArch) -> RoutingConfig:
    """The layer routing a config.json describes."""
    return RoutingConfig(
        top_k=moe.top_k,
        renormalize=moe.renormalize,
        scoring_func=moe.scoring_func,
        num_expert_groups=moe.num_expert_groups,
        topk_groups=moe.topk_groups,
        routed_scaling_factor=moe.routed_scaling_factor,
        use_correction_bias=moe.use_correction_bias,
        weights_in_logits_dtype=moe.weights_in_logits_dtype,
    )


def dense_mlp(arch: ModelArch, context: LayerContext, intermediate_size: int) -> LlamaMLP:
    """Llama's gated MLP with another intermediate width (shared experts, dense layers)."""
    return LlamaMLP(
        dataclasses.replace(arch, intermediate_size=intermediate_size), context, bias=False
    )


class SparseMoeBlock(nn.Module):
    """One layer's MoE MLP: router, routed experts, optional shared expert.

    Args:
        shared_name: the shared expert's module name ('shared_expert' for Qwen2-MoE,
            'shared_experts' for DeepSeek), so that checkpoint names map one to one.
        router_fp32: compute the router logits in float32 (DeepSeek-V3 does).
    """

    def __init__(
        self,
        arch: ModelArch,
        moe: MoeArch,
        context: LayerContext,
        *,
        prefix: str,
        shared_name: str = "shared_expert",
        router_fp32: bool = False,
    ) -> None:
        super().__init__()
        self.router_fp32 = router_fp32
        self.gate = Linear(arch.hidden_size, moe.num_experts, context, bias=False)
        self.experts = FusedMoE(
            moe.num_experts,
            arch.hidden_size,
            moe.moe_intermediate_size,
            routing_config(moe),
            context,
            num_redundant_experts=context.num_redundant_experts,
            prefix=f"{prefix}.experts",
        )
        self.shared_name = shared_name
        if moe.shared_expert_intermediate_size > 0:
            # NOTE: no bias anywhere in a shared expert: forward may skip its row-parallel sum.
            self.add_module(
                shared_name, dense_mlp(arch, context, moe.shared_expert_intermediate_size)
            )
        self.shared_expert_gate = (
            Linear(arch.hidden_size, 1, context, bias=False) if moe.shared_expert_gate else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.router_fp32:
            logits = F.linear(hidden_states.float(), self.gate.weight.float())
        else:
            logits = self.gate(hidden_states)
        shared: LlamaMLP | None = getattr(self, self.shared_name, None)
        if shared is None:
            return self.experts(hidden_states, logits)
        # NOTE: the shared expert's down projection without its own all-reduce: its partial
        # sum joins the routed experts' (the same TP ranks), one all-reduce for both.
        act = shared.act_fn(shared.gate_up_proj(hidden_states))
        shared_out = F.linear(act, shared.down_proj.weight)
        if self.shared_expert_gate is not None:
            shared_out = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared_out
        return self.experts(hidden_states, logits, shared_output=shared_out)


class MoeModelMixin(nn.Module):
    """MoE loading and `moe_layers()` for a Llama-based model (mix in before the model class).

    `checkpoint_renames` maps checkpoint name fragments to ours (Mixtral's
    '.block_sparse_moe.' is our '.mlp.').
    """

    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def moe_layers(self) -> list[FusedMoE]:
        """This rank's MoE layers in layer order."""
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def _rename(self, name: str) -> str:
        for theirs, ours in self.checkpoint_renames:
            name = name.replace(theirs, ours)
        # DeepSeek keeps the correction bias on its router; ours routes inside FusedMoE.
        return name.replace(".gate.e_score_correction_bias", ".experts.e_score_correction_bias")

    def _dense_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """Load the expert tensors into their `FusedMoE`; yield the others (renamed)."""
        modules = dict(self.named_modules())
        for name, tensor in weights:
            name = self._rename(name)
            match = _EXPERT_TENSOR.match(name)
            if match is None:
                yield name, tensor
                continue
            layer = modules.get(match["module"])
            if layer is None:
                continue  # another pipeline stage's layer
            if not isinstance(layer, FusedMoE):
                raise ValueError(f"checkpoint tensor {name} names no MoE layer of this model")
            layer.load_expert_weight(int(match["expert"]), _PART_OF[match["proj"]], tensor, name)

    def load_moe_weights(
        self,
        weights: Iterable[tuple[str, CheckpointTensor]],
        load_dense: Callable[[Iterable[tuple[str, CheckpointTensor]]], set[str]],
    ) -> set[str]:
        """Route expert tensors to the MoE layers and the rest to `load_dense` (the dense
        model's `load_weights`); returns every parameter name filled."""
        loaded = set(load_dense(self._dense_weights(weights)))
        for name, module in self.named_modules():
            if isinstance(module, FusedMoE) and module.fully_loaded():
                loaded.update({f"{name}.w13_weight", f"{name}.w2_weight"})
        return loaded
