"""The MoE layer: routing recipes against hand-written references, the vectorised sort, the
EPLB contract (maps, load counting, layout) and expert-parallel sharding that sums to the
unsharded layer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from fleetserve.engine.distributed.group import GroupCoordinator
from fleetserve.engine.layers.fused_moe import FusedMoE, RoutingConfig, select_experts
from fleetserve.engine.layers.fused_moe.torch_experts import sort_by_expert, torch_experts
from fleetserve.engine.layers.layer_context import LayerContext

H, INTER, E = 16, 8, 8


def _context(
    ep_rank: int = 0, ep_size: int = 1, tp_rank: int = 0, tp_size: int = 1
) -> LayerContext:
    def group(rank: int, size: int) -> GroupCoordinator | None:
        return None if size == 1 else GroupCoordinator(list(range(size)), rank)

    return LayerContext(
        dtype=torch.float32,
        device=torch.device("cpu"),
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_group=group(tp_rank, tp_size),
        ep_rank=ep_rank,
        ep_size=ep_size,
        ep_group=group(ep_rank, ep_size),
    )


def test_softmax_topk_with_and_without_renormalisation() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.7, 0.5, 4.0, -1.0]])
    probs = logits.softmax(-1)
    weights, ids = select_experts(logits, RoutingConfig(top_k=2, renormalize=False))
    assert ids.tolist() == [[1, 2], [2, 0]] and ids.dtype == torch.int64
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormed, same_ids = select_experts(logits, RoutingConfig(top_k=2, renormalize=True))
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(renormed, weights / weights.sum(-1, keepdim=True))
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))


def _grouped_reference(
    logits: torch.Tensor, bias: torch.Tensor, groups: int, topk_groups: int, k: int, scale: float
) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Token by token, as DeepSeek-V3 describes it: sigmoid scores, biased choice, groups scored
    by their two best biased scores, experts chosen only inside the best groups."""
    chosen: list[list[int]] = []
    weights: list[dict[int, float]] = []
    for row in logits:
        scores = row.sigmoid()
        biased = (scores + bias).tolist()
        size = len(biased) // groups
        group_score = [
            sum(sorted(biased[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(groups)
        ]
        keep = sorted(range(groups), key=lambda g: -group_score[g])[:topk_groups]
        allowed = [e for e in range(len(biased)) if e // size in keep]
        top = sorted(allowed, key=lambda e: -biased[e])[:k]
        w = scores[top]
        chosen.append(sorted(top))
        weights.append(dict(zip(top, (w / w.sum() * scale).tolist(), strict=True)))
    return chosen, weights


def test_grouped_topk_with_correction_bias_matches_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, E, generator=gen)
    bias = 0.5 * torch.randn(E, generator=gen)  # large enough to change choices
    config = RoutingConfig(
        top_k=3,
        renormalize=True,
        scoring_func="sigmoid",
        num_expert_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
        use_correction_bias=True,
    )
    weights, ids = select_experts(logits, config, bias)
    chosen, ref_weights = _grouped_reference(logits, bias, 4, 2, 3, 2.5)
    assert [sorted(row) for row in ids.tolist()] == chosen
    for t, row in enumerate(ids.tolist()):
        for slot, expert in enumerate(row):
            assert weights[t, slot].item() == pytest.approx(ref_weights[t][expert], rel=1e-5)
    # The bias changes the choice but not the weights: they are the unbiased scores.
    unbiased = select_experts(logits, config, torch.zeros(E))[1]
    assert not torch.equal(unbiased.sort(-1)[0], ids.sort(-1)[0])


def test_grouped_topk_without_bias_scores_groups_by_their_best_expert() -> None:
    # Group 0 = experts {0, 1}: best 0.9; group 1 = {2, 3}: 0.6 + 0.6 (larger sum, smaller max).
    logits = torch.tensor([[0.9, 0.0, 0.6, 0.6]]).logit()
    config = RoutingConfig(
        top_k=1, renormalize=False, scoring_func="sigmoid", num_expert_groups=2, topk_groups=1
    )
    assert select_experts(logits, config)[1].tolist() == [[0]]
    biased = dataclasses.replace(config, use_correction_bias=True)
    assert select_experts(logits, biased, torch.zeros(4))[1].tolist() in ([[2]], [[3]])


def test_routing_refuses_what_cannot_apply() -> None:
    with pytest.raises(ValueError, match="scoring_func must be one of"):
        RoutingConfig(top_k=1, renormalize=False, scoring_func="relu")
    with pytest.raises(ValueError, match="topk_group must be in"):
        RoutingConfig(top_k=1, renormalize=False, num_expert_groups=2, topk_groups=3)
    with pytest.raises(ValueError, match="divisible by n_group"):
        RoutingConfig(top_k=1, renormalize=False, num_expert_groups=3).check(8)


def test_sort_by_expert_groups_pairs_and_drops_foreign_ones() -> None:
    ids = torch.tensor([[2, 0], [5, 2], [0, -1]])  # 5 and -1: not local (3 local experts)
    order, counts = sort_by_expert(ids, 3)
    assert counts.tolist() == [2, 0, 2]
    assert order[:4].tolist() == [1, 4, 0, 3]


def _dense_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, slot] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _random_experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)


def test_torch_experts_match_the_per_token_loop() -> None:
    w13, w2 = _random_experts()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, H, generator=gen)
    weights, ids = select_experts(torch.randn(11, E, generator=gen), RoutingConfig(2, True))
    # NOTE: batched GEMMs against per-token matrix-vector products sum in another order; on
    # Intel CPUs MKL's AVX-512 kernels put the difference just past float32's default rtol.
    torch.testing.assert_close(
        torch_experts(x, w13, w2, weights, ids),
        _dense_reference(x, w13, w2, weights, ids),
        rtol=1e-5,
        atol=1e-4,
    )


def _layer(
    context: LayerContext,
    w13: torch.Tensor,
    w2: torch.Tensor,
    num_redundant_experts: int = 0,
    physical_to_logical: list[int] | None = None,
) -> FusedMoE:
    layer = FusedMoE(
        E, H, INTER, RoutingConfig(top_k=2, renormalize=True), context,
        num_redundant_experts=num_redundant_experts, physical_to_logical=physical_to_logical,
    )  # fmt: skip
    for e in range(E):
        layer.load_expert_weight(e, "gate", w13[e, :INTER], f"experts.{e}.w1.weight")
        layer.load_expert_weight(e, "up", w13[e, INTER:], f"experts.{e}.w3.weight")
        layer.load_expert_weight(e, "down", w2[e], f"experts.{e}.w2.weight")
    assert layer.fully_loaded()
    layer.reduce_group = None  # the test sums the ranks' partial outputs itself
    return layer


@pytest.mark.parametrize(("ep_size", "tp_size"), [(2, 2), (4, 4), (1, 2)])
def test_sharded_layers_sum_to_the_unsharded_layer(ep_size: int, tp_size: int) -> None:
    """EP: each rank holds E / ep whole experts; TP without EP: each expert's INTER / tp rows.
    The sum over ranks of their outputs (what the all-reduce computes) is the full layer's."""
    w13, w2 = _random_experts()
    gen = torch.Generator().manual_seed(2)
    x, logits = torch.randn(13, H, generator=gen), torch.randn(13, E, generator=gen)
    full = _layer(_context(), w13, w2)(x, logits)
    parts = []
    for rank in range(tp_size):
        # With data_parallel_size 1 the EP group is the TP group (the experts are whole).
        context = _context(rank if ep_size > 1 else 0, ep_size, rank, tp_size)
        layer = _layer(context, w13, w2)
        if ep_size > 1:
            local = layer.num_local_physical_experts
            assert local == E // ep_size and list(layer.local_physical_experts) == list(
                range(rank * local, (rank + 1) * local)
            )
            torch.testing.assert_close(
                layer.w13_weight.data, w13[rank * local : (rank + 1) * local]
            )
        else:
            assert layer.w13_weight.shape == (E, 2 * INTER // tp_size, H)
        parts.append(layer(x, logits))
    torch.testing.assert_close(sum(parts), full)


@dataclass
class _Maps:
    logical_to_physical: torch.Tensor
    logical_replica_count: torch.Tensor


def test_eplb_maps_route_to_replicas_and_load_is_counted() -> None:
    """L = 8 logical experts, R = 2 redundant slots holding replicas of experts 3 and 5; the
    replicas share the tokens by (token + slot) % count, and outputs do not change."""
    w13, w2 = _random_experts()
    p2l = [*range(E), 3, 5]
    layer = _layer(_context(1, 2, 1, 2), w13, w2, num_redundant_experts=2, physical_to_logical=p2l)
    assert (layer.num_physical_experts, layer.num_local_physical_experts) == (10, 5)
    assert list(layer.local_physical_experts) == [5, 6, 7, 8, 9]
    # Local slot 3 = physical 8 = a replica of logical 3: loaded from expert 3's tensors.
    torch.testing.assert_close(layer.expert_weights()[0][3], w13[3])
    torch.testing.assert_close(layer.expert_weights()[1][4], w2[5])
    l2p = torch.full((E, 2), -1, dtype=torch.long)
    l2p[:, 0] = torch.arange(E)
    l2p[3, 1], l2p[5, 1] = 8, 9
    counts = torch.ones(E, dtype=torch.long)
    counts[3] = counts[5] = 2
    layer.eplb_maps = _Maps(l2p, counts)
    layer.expert_load = torch.zeros(10, dtype=torch.long)
    logical = torch.tensor([[3, 5], [3, 0], [5, 3]])
    physical = layer.to_physical(logical)
    assert physical.tolist() == [[3, 9], [8, 0], [5, 8]]
    gen = torch.Generator().manual_seed(3)
    x, logits = torch.randn(9, H, generator=gen), torch.randn(9, E, generator=gen)
    layer(x, logits)
    assert int(layer.expert_load.sum()) == 9 * 2
    # Both EP ranks together equal the unsharded, unreplicated layer.
    rank0 = _layer(_context(0, 2, 0, 2), w13, w2, num_redundant_experts=2, physical_to_logical=p2l)
    rank0.eplb_maps = layer.eplb_maps
    torch.testing.assert_close(
        rank0(x, logits) + layer(x, logits), _layer(_context(), w13, w2)(x, logits)
    )


def test_layer_refuses_bad_layouts() -> None:
    with pytest.raises(ValueError, match="must be divisible by the expert-parallel size"):
        FusedMoE(E, H, INTER, RoutingConfig(2, True), _context(0, 3, 0, 3))
    with pytest.raises(ValueError, match="needs data-parallel dispatch"):
        FusedMoE(E, H, INTER, RoutingConfig(2, True), _context(0, 2))
    with pytest.raises(ValueError, match="physical_to_logical must list 9"):
        FusedMoE(
            E, H, INTER, RoutingConfig(2, True), _context(), num_redundant_experts=1,
            physical_to_logical=list(range(E)),
        )  # fmt: skip
    redundant = FusedMoE(
        E, H, INTER, RoutingConfig(2, True), _context(), num_redundant_experts=1,
        physical_to_logical=[*range(E), 0],
    )  # fmt: skip
    with pytest.raises(ValueError, match="eplb_maps must be set"):
        redundant.to_physical(torch.zeros(1, 2, dtype=torch.long))


class _CountingTensor:
    """A checkpoint tensor that records which experts' tensors were read (narrowed)."""

    def __init__(self, tensor: torch.Tensor, expert: int, reads: list[int]) -> None:
        self._tensor, self._expert, self._reads = tensor, expert, reads
        self.shape = tensor.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self._reads.append(self._expert)
        return self._tensor.narrow(dim, start, length)


def test_an_expert_parallel_rank_reads_only_its_own_experts() -> None:
    w13, w2 = _random_experts()
    layer = FusedMoE(E, H, INTER, RoutingConfig(2, True), _context(1, 4, 1, 4))
    reads: list[int] = []
    for e in range(E):
        for part, tensor in (("gate", w13[e, :INTER]), ("up", w13[e, INTER:]), ("down", w2[e])):
            layer.load_expert_weight(e, part, _CountingTensor(tensor, e, reads), f"e{e}.{part}")
    assert sorted(set(reads)) == [2, 3] and len(reads) == 6
    assert layer.fully_loaded()
