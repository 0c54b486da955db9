"""DeepSeek's EPLB placement as a pure, deterministic function of the measured expert load.

`rebalance(load, num_physical, num_groups, num_nodes, num_ranks, policy)` answers, for every MoE
layer, which logical expert each physical slot holds (`physical_to_logical`). Three greedy steps,
as deepseek-ai/EPLB describes them:

1. replicate: every logical expert gets one slot, then each spare slot goes to the expert whose
   load per replica is the largest (ties: the lowest expert id);
2. pack: items sorted by load, heaviest first (ties: the lowest index), each onto the lightest
   pack that still has room (ties: the lowest pack), so every pack holds exactly n / m items;
3. hierarchical (`num_groups % num_nodes == 0`): pack expert groups onto nodes, replicate inside
   each node, pack the node's slots onto its ranks, which keeps group-limited routing inside a
   node; global: the same with one node and one group (replicate over all experts, pack onto all
   ranks).

Only torch on the CPU and integer/float arithmetic in a fixed order, so every rank that feeds the
same (all-reduced) load gets the same plan: that is what lets the ranks commit a new map without
exchanging it.
"""

from __future__ import annotations

import torch

__all__ = ["POLICIES", "balancedness", "pack", "rebalance", "replicate"]

POLICIES: tuple[str, ...] = ("global", "hierarchical")


def replicate(
    load: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spread `num_slots` slots over the items of each row of `load` [rows, n] (n <= num_slots).

    Returns (slot_item [rows, num_slots], slot_replica [rows, num_slots], item_count [rows, n]):
    slot s holds item `slot_item[s]` as its `slot_replica[s]`-th replica; the first n slots hold
    items 0..n-1 once each.
    """
    rows, n = load.shape
    if num_slots < n:
        raise ValueError(f"num_slots must be >= the {n} items, got {num_slots}")
    slot_item = torch.arange(num_slots, dtype=torch.int64).repeat(rows, 1)
    slot_replica = torch.zeros(rows, num_slots, dtype=torch.int64)
    count = torch.ones(rows, n, dtype=torch.int64)
    weight = load.to(torch.float64)
    row_ids = torch.arange(rows)
    for slot in range(n, num_slots):
        # NOTE: argmax returns the first of equal maxima: the lowest item wins a tie.
        hottest = (weight / count).argmax(dim=-1)
        slot_item[:, slot] = hottest
        slot_replica[:, slot] = count[row_ids, hottest]
        count[row_ids, hottest] += 1
    return slot_item, slot_replica, count


def pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Put the n items of each row of `weight` [rows, n] into `num_packs` packs of n / num_packs.

    Returns (pack_of [rows, n], rank_in_pack [rows, n]). With one item per pack the items stay
    where they are (nothing to balance, and nothing moves).
    """
    rows, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"num_packs must divide the {n} items, got {num_packs}")
    per_pack = n // num_packs
    if per_pack == 1:
        same = torch.arange(n, dtype=torch.int64).repeat(rows, 1)
        return same, torch.zeros_like(same)
    pack_of = torch.empty(rows, n, dtype=torch.int64)
    rank_in_pack = torch.empty(rows, n, dtype=torch.int64)
    order = weight.to(torch.float64).argsort(dim=-1, descending=True, stable=True).tolist()
    values = weight.to(torch.float64).tolist()
    for row in range(rows):
        totals = [0.0] * num_packs
        filled = [0] * num_packs
        for item in order[row]:
            target = min(
                (p for p in range(num_packs) if filled[p] < per_pack), key=totals.__getitem__
            )
            pack_of[row, item] = target
            rank_in_pack[row, item] = filled[target]
            totals[target] += values[row][item]
            filled[target] += 1
    return pack_of, rank_in_pack


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=perm.dtype).expand_as(perm))
    return inv


def _hierarchical(
    load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    layers, num_logical = load.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    slots_per_node = num_physical // num_nodes
    slots_per_rank = num_physical // num_ranks

    # 1. groups onto nodes: a node-major order of the logical experts ("node logical" ids).
    group_load = load.unflatten(-1, (num_groups, group_size)).sum(-1)
    node_of_group, rank_of_group = pack(group_load, num_nodes)
    group_start = (node_of_group * groups_per_node + rank_of_group) * group_size
    logical_to_nl = (group_start.unsqueeze(-1) + torch.arange(group_size)).flatten(-2)
    nl_to_logical = _inverse(logical_to_nl)

    # 2. replicas inside each node (one row per layer and node).
    nl_load = load.gather(-1, nl_to_logical).view(-1, logical_per_node)
    slot_nl, _replica, nl_count = replicate(nl_load, slots_per_node)

    # 3. a node's slots onto its ranks, each replica carrying an equal share of its expert.
    slot_load = (nl_load / nl_count).gather(-1, slot_nl)
    rank_of_slot, index_in_rank = pack(slot_load, num_ranks // num_nodes)
    position_to_slot = _inverse(rank_of_slot * slots_per_rank + index_in_rank)
    placed_nl = slot_nl.gather(-1, position_to_slot).view(layers, num_nodes, -1)
    placed_nl = placed_nl + (torch.arange(num_nodes) * logical_per_node).view(1, -1, 1)
    return nl_to_logical.gather(-1, placed_nl.flatten(-2))


def _check(num_logical: int, num_physical: int, groups: int, nodes: int, ranks: int) -> None:
    if num_physical < num_logical:
        raise ValueError(
            f"num_physical must be >= the {num_logical} logical experts, got {num_physical}"
        )
    if ranks < 1 or num_physical % ranks:
        raise ValueError(f"num_physical ({num_physical}) must divide evenly over the {ranks} ranks")
    if nodes < 1 or ranks % nodes:
        raise ValueError(f"num_nodes must divide the {ranks} ranks, got {nodes}")
    if groups < 1 or num_logical % groups:
        raise ValueError(f"num_groups must divide the {num_logical} experts, got {groups}")


def rebalance(
    load: torch.Tensor,
    num_physical: int,
    *,
    num_ranks: int,
    num_groups: int = 1,
    num_nodes: int = 1,
    policy: str = "global",
) -> torch.Tensor:
    """The new `physical_to_logical` [layers, num_physical] for `load` [layers, num_logical].

    `policy`: 'hierarchical' places expert groups by node when `num_groups % num_nodes == 0`
    (otherwise, and for 'global', it balances over all ranks as one node). Physical slot p lands
    on rank p // (num_physical // num_ranks).

    Raises:
        ValueError: a policy not in POLICIES, or sizes that do not divide (the message names
            the argument).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if load.dim() != 2:
        raise ValueError(f"load must be [layers, logical experts], got shape {list(load.shape)}")
    num_logical = load.size(1)
    _check(num_logical, num_physical, num_groups, num_nodes, num_ranks)
    weight = load.detach().to("cpu", torch.float64)
    if policy == "hierarchical" and num_groups % num_nodes == 0:
        return _hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)
    return _hierarchical(weight, num_physical, 1, 1, num_ranks)


def balancedness(rank_load: torch.Tensor) -> torch.Tensor:
    """Per layer, mean ÷ max of the per-rank load `rank_load` [layers, ranks] (1 = perfectly
    even; a layer with no load counts as 1)."""
    load = rank_load.to(torch.float64)
    peak = load.max(dim=-1).values
    mean = load.mean(dim=-1)
    return torch.where(peak > 0, mean / peak.clamp_min(1e-30), torch.ones_like(peak))
