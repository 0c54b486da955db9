from __future__ import annotations

import pytest

from fleetserve.api.topology import group_size, rank_layout


def test_seed_example_tp2_pp4() -> None:
    layout = rank_layout(8, tensor=2, pipeline=4)
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pipeline == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.data == [[r] for r in range(8)]
    assert layout.expert == [[r] for r in range(8)]


def test_data_and_expert_groups() -> None:
    layout = rank_layout(8, tensor=2, pipeline=2, data=2, expert=True)
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pipeline == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.expert == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="world_size must equal"):
        rank_layout(6, tensor=4)
    with pytest.raises(ValueError, match="tensor must be >= 1"):
        rank_layout(1, tensor=0)


def test_group_size() -> None:
    assert group_size(8, 2, 8) == 2
    assert group_size(4, 1, 4) == 1
    assert group_size(1, 1, 0) == 1
    assert group_size(2, 1, 8) == 1
    with pytest.raises(ValueError, match="gpus_per_pod"):
        group_size(1, 1, -1)
