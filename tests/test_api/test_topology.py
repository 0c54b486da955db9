from __future__ import annotations

import itertools

import pytest

from fleetserve.api.topology import group_size, rank_layout, world_size


def test_seed_example_tp2_pp4() -> None:
    layout = rank_layout(8, tensor=2, pipeline=4)
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pipeline == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.data == [[r] for r in range(8)]
    assert layout.expert == [[r] for r in range(8)]


def test_data_and_expert_groups() -> None:
    """The seed's grid (notes part 2 §2.4: reshape(-1, DP, PP, TP)), every group kind."""
    layout = rank_layout(8, tensor=2, pipeline=2, data=2, expert=True)
    assert layout.world_size == 8
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pipeline == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.expert == [[0, 1, 4, 5], [2, 3, 6, 7]]
    dense = rank_layout(8, tensor=2, pipeline=2, data=2)
    assert dense.expert == [[r] for r in range(8)]
    assert (dense.tensor, dense.pipeline, dense.data) == (
        layout.tensor,
        layout.pipeline,
        layout.data,
    )


def test_data_outside_tensor_without_pipeline() -> None:
    layout = rank_layout(4, tensor=2, data=2, expert=True)
    assert layout.tensor == [[0, 1], [2, 3]]
    assert layout.data == [[0, 2], [1, 3]]
    assert layout.pipeline == [[0], [1], [2], [3]]
    assert layout.expert == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("tp", "pp", "dp"), [(t, p, d) for t, p, d in itertools.product((1, 2, 3), repeat=3)]
)
def test_groups_follow_the_grid_formula(tp: int, pp: int, dp: int) -> None:
    """rank = (d × PP + p) × TP + t; each kind partitions the ranks, listed by first rank."""
    layout = rank_layout(tp * pp * dp, tensor=tp, pipeline=pp, data=dp, expert=True)

    def rank(d: int, p: int, t: int) -> int:
        return (d * pp + p) * tp + t

    grid = list(itertools.product(range(dp), range(pp), range(tp)))
    assert sorted(layout.tensor) == sorted(
        [rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)
    )
    assert sorted(layout.pipeline) == sorted(
        [rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)
    )
    assert sorted(layout.data) == sorted(
        [rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)
    )
    assert sorted(layout.expert) == sorted(
        sorted(rank(d, p, t) for d in range(dp) for t in range(tp)) for p in range(pp)
    )
    for groups in (layout.tensor, layout.pipeline, layout.data, layout.expert):
        assert sorted(r for g in groups for r in g) == list(range(len(grid)))
        assert groups == sorted(groups) and all(g == sorted(g) for g in groups)


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="world_size must be a multiple"):
        rank_layout(6, tensor=4)
    with pytest.raises(ValueError, match="world_size must be a multiple"):
        rank_layout(4, tensor=2, pipeline=2, data=2)
    with pytest.raises(ValueError, match="tensor must be >= 1"):
        rank_layout(1, tensor=0)
    with pytest.raises(ValueError, match="data must be >= 1"):
        rank_layout(1, data=0)


def test_world_and_group_size_count_data() -> None:
    assert world_size(tensor=2, pipeline=2, data=2) == 8
    assert group_size(tensor=8, pipeline=2, data=1, gpus_per_pod=8) == 2
    assert group_size(tensor=4, pipeline=1, data=1, gpus_per_pod=4) == 1
    assert group_size(tensor=4, pipeline=1, data=2, gpus_per_pod=4) == 2
    assert group_size(tensor=2, pipeline=1, data=4, gpus_per_pod=8) == 1
    assert group_size(tensor=2, pipeline=2, data=3, gpus_per_pod=8) == 2
    assert group_size(tensor=1, pipeline=1, data=1, gpus_per_pod=0) == 1
    assert group_size(tensor=2, pipeline=1, data=1, gpus_per_pod=8) == 1
    with pytest.raises(ValueError, match="gpus_per_pod"):
        group_size(tensor=1, pipeline=1, data=1, gpus_per_pod=-1)
    with pytest.raises(ValueError, match="data must be >= 1"):
        world_size(tensor=1, pipeline=1, data=0)


def test_external_data_parallel_copies_the_grid() -> None:
    """A world larger than DP × PP × TP holds independent copies of the grid (ExternalDP, the
    leading -1 of the seed's reshape), each with its own groups."""
    layout = rank_layout(8, tensor=2, pipeline=2)
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pipeline == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data == [[r] for r in range(8)]
    moe = rank_layout(8, tensor=2, data=2, expert=True)
    assert moe.data == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert moe.expert == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert moe.group_of("expert", 6) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="kind must be one of"):
        moe.group_of("context", 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\)"):
        moe.group_of("tensor", 8)
