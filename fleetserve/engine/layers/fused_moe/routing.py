"""Expert selection: router logits [T, E] → (weights [T, k] float32, logical ids [T, k] int64).

Three recipes, all vectorised over the tokens (one topk per step, no Python loop):

- softmax top-k (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax over all experts in float32, the k
  largest, optionally renormalised to sum to one (Mixtral always; Qwen's `norm_topk_prob`);
- sigmoid scoring (DeepSeek-V3): each expert's score is sigmoid(logit); the choice ranks
  score + `e_score_correction_bias`, while the weights are the unbiased scores;
- grouped top-k (DeepSeek-V2/V3 `n_group`, `topk_group`): experts are split into equal groups,
  each group is scored (the sum of its two best biased scores when a correction bias is used, as
  V3 does, else its best score, as V2 does), and a token picks its k experts only inside its
  `topk_group` best groups.

The weights are finally multiplied by `routed_scaling_factor` (1 unless the config says).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SCORING_FUNCS", "RoutingConfig", "select_experts"]

SCORING_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How one MoE layer picks its experts (from the model's config.json)."""

    top_k: int
    """Experts per token (`num_experts_per_tok`)."""
    renormalize: bool
    """Rescale each token's k weights to sum to one (`norm_topk_prob`; Mixtral: always)."""
    scoring_func: str = "softmax"
    """'softmax' or 'sigmoid' (DeepSeek-V3)."""
    num_expert_groups: int = 1
    """Groups the experts are split into (`n_group`); 1: plain top-k."""
    topk_groups: int = 1
    """Groups each token may pick experts from (`topk_group`)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the final weights."""
    use_correction_bias: bool = False
    """DeepSeek-V3's `e_score_correction_bias` is added to the scores for the choice only."""
    weights_in_logits_dtype: bool = False
    """Round the final weights to the router logits' dtype (Qwen-MoE does; the others keep
    float32), so that a bfloat16 model weights its experts as its reference does."""

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"num_experts_per_tok must be >= 1, got {self.top_k}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}"
            )
        if self.num_expert_groups < 1:
            raise ValueError(f"n_group must be >= 1, got {self.num_expert_groups}")
        if not 1 <= self.topk_groups <= self.num_expert_groups:
            raise ValueError(
                f"topk_group must be in [1, n_group={self.num_expert_groups}], "
                f"got {self.topk_groups}"
            )

    def check(self, num_experts: int) -> None:
        """Raises ValueError when this routing cannot apply to `num_experts` experts."""
        if self.top_k > num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be <= the number of experts "
                f"({num_experts})"
            )
        if num_experts % self.num_expert_groups != 0:
            raise ValueError(
                f"the number of experts ({num_experts}) must be divisible by n_group "
                f"({self.num_expert_groups})"
            )
        per_group = num_experts // self.num_expert_groups
        if self.top_k > per_group * self.topk_groups:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be <= topk_group × experts per group "
                f"({self.topk_groups} × {per_group})"
            )


def _group_mask(choice: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    """[T, E] bool: the experts inside each token's `topk_groups` best groups."""
    num_tokens, num_experts = choice.shape
    groups = choice.view(num_tokens, config.num_expert_groups, -1)
    if config.use_correction_bias:
        group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(dim=-1)
    else:
        group_scores = groups.amax(dim=-1)
    best = torch.topk(group_scores, k=config.topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool)
    mask.scatter_(1, best, True)
    return mask.unsqueeze(-1).expand_as(groups).reshape(num_tokens, num_experts)


def select_experts(
    router_logits: torch.Tensor,
    config: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts.

    Args:
        router_logits: [T, E] (any float dtype; scored in float32).
        config: the layer's routing.
        correction_bias: [E] when `config.use_correction_bias` (added to the scores for the
            choice only).

    Returns:
        (weights [T, k] float32, or the logits' dtype under `weights_in_logits_dtype`;
        logical expert ids [T, k] int64).
    """
    config.check(router_logits.shape[-1])
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if config.scoring_func == "softmax" else logits.sigmoid()
    choice = scores
    if config.use_correction_bias:
        if correction_bias is None:
            raise ValueError("correction_bias is required when use_correction_bias is set")
        choice = scores + correction_bias.float()
    if config.num_expert_groups > 1:
        choice = choice.masked_fill(~_group_mask(choice, config), float("-inf"))
    if choice is scores:
        weights, ids = torch.topk(scores, config.top_k, dim=-1)
    else:
        ids = torch.topk(choice, config.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if config.renormalize:
        # NOTE: sigmoid scores can all be tiny; DeepSeek guards the division with 1e-20.
        eps = 1e-20 if config.scoring_func == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    if config.weights_in_logits_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, ids
