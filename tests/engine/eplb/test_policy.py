"""The DeepSeek placement and the maps (issue 17, acceptance 2)."""

from __future__ import annotations

import pytest
import torch

from fleetserve.engine.eplb.maps import ExpertMaps
from fleetserve.engine.eplb.policy import balancedness, pack, rebalance, replicate

# deepseek-ai/EPLB README: 2 layers, 12 experts in 4 groups, 16 slots, 2 nodes x 4 GPUs.
README_LOAD = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PLAN = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def test_the_readme_example_reproduces_its_published_plan() -> None:
    plan = rebalance(README_LOAD, 16, num_ranks=8, num_groups=4, num_nodes=2, policy="hierarchical")
    assert plan.tolist() == README_PLAN
    maps = ExpertMaps.from_physical_to_logical(plan, 12)
    # The anchors' figures for this plan (anchors-engine.md §5): 0.83 and 0.81 per GPU,
    # against 0.47 and 0.49 for one expert per GPU.
    assert [round(b, 2) for b in maps.balancedness(README_LOAD, 8).tolist()] == [0.83, 0.81]
    # The replicated experts are the hottest per replica: 5, 10, 4 and 1 in layer 0.
    assert maps.logical_replica_count[0].tolist() == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]


@pytest.mark.parametrize("policy", ["global", "hierarchical"])
@pytest.mark.parametrize(
    ("experts", "slots", "ranks", "groups", "nodes"),
    [(8, 8, 4, 1, 1), (16, 24, 8, 4, 2), (12, 16, 4, 4, 2), (6, 9, 3, 3, 1)],
)
def test_maps_are_consistent_inverse_and_deterministic(
    policy: str, experts: int, slots: int, ranks: int, groups: int, nodes: int
) -> None:
    gen = torch.Generator().manual_seed(experts * slots)
    load = torch.randint(0, 1000, (3, experts), generator=gen)
    plan = rebalance(
        load, slots, num_ranks=ranks, num_groups=groups, num_nodes=nodes, policy=policy
    )
    assert plan.shape == (3, slots)
    maps = ExpertMaps.from_physical_to_logical(plan, experts)
    maps.check()  # counts = non-(-1) entries, each listed slot holds its expert, all >= 1
    for layer in range(3):
        for slot in range(slots):
            expert = int(plan[layer, slot])
            assert slot in maps.logical_to_physical[layer, expert].tolist()
    again = rebalance(
        load.clone(), slots, num_ranks=ranks, num_groups=groups, num_nodes=nodes, policy=policy
    )
    assert torch.equal(plan, again)


def test_hierarchical_keeps_each_group_on_one_node() -> None:
    gen = torch.Generator().manual_seed(3)
    load = torch.randint(1, 500, (2, 16), generator=gen)
    plan = rebalance(load, 24, num_ranks=8, num_groups=4, num_nodes=2, policy="hierarchical")
    for layer in range(2):
        for group in range(4):
            nodes = {slot // 12 for slot in range(24) if int(plan[layer, slot]) // 4 == group}
            assert len(nodes) == 1


def test_skewed_load_goes_from_about_half_to_at_least_0_8() -> None:
    # A Zipf-like skew (s = 1.5) over 16 experts on 4 ranks with 4 redundant slots.
    load = torch.tensor([[1000.0 / (i + 1) ** 1.5 for i in range(16)]] * 2)
    load[1] = load[1].flip(0)
    before = ExpertMaps.initial(2, 16, 20)
    after = ExpertMaps.from_physical_to_logical(rebalance(load, 20, num_ranks=4), 16)
    b_before = before.balancedness(load, 4).tolist()
    b_after = after.balancedness(load, 4).tolist()
    assert all(0.4 <= b <= 0.6 for b in b_before), b_before
    assert all(b >= 0.8 for b in b_after), b_after


def test_greedy_steps() -> None:
    slot_item, replica, count = replicate(torch.tensor([[10.0, 40.0, 20.0]]), 5)
    # 40 is the hottest; then 40 / 2 = 20 ties expert 2's 20: the lowest id (1) wins.
    assert slot_item.tolist() == [[0, 1, 2, 1, 1]]
    assert replica.tolist() == [[0, 0, 0, 1, 2]] and count.tolist() == [[1, 3, 1]]
    pack_of, rank = pack(torch.tensor([[5.0, 1.0, 4.0, 2.0]]), 2)
    # 5 → pack 0, 4 → pack 1, 2 → pack 1 (4 < 5), 1 → pack 0 (the only one with room).
    assert pack_of.tolist() == [[0, 0, 1, 1]] and rank.tolist() == [[0, 1, 0, 1]]
    assert balancedness(torch.tensor([[1.0, 3.0], [0.0, 0.0]])).tolist() == [2 / 3, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ranks": 3}, "ranks"),
        ({"num_ranks": 4, "policy": "random"}, "policy"),
        ({"num_ranks": 4, "num_groups": 3, "policy": "hierarchical"}, "num_groups"),
        ({"num_ranks": 4, "num_nodes": 3}, "num_nodes"),
    ],
)
def test_bad_sizes_are_refused_by_name(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rebalance(torch.ones(1, 8), 8, **kwargs)  # type: ignore[arg-type]


def test_maps_refuse_an_expert_without_a_slot() -> None:
    with pytest.raises(ValueError, match="logical expert 3 of MoE layer 0 has no slot"):
        ExpertMaps.from_physical_to_logical(torch.tensor([[0, 1, 2, 2]]), 4)
