"""The head-slice mapping between tensor-parallel engines (pure functions)."""

from __future__ import annotations

import pytest

from fleetserve.engine.kv_transfer.head_map import (
    HeadSlice,
    KVLayout,
    kv_heads_of_rank,
    plan_head_slices,
)
from fleetserve.engine.layers.linear import num_kv_heads_per_rank, qkv_slices


def _layout(tp: int, heads: int = 4, pp: int = 1) -> KVLayout:
    return KVLayout(tp_size=tp, pp_size=pp, num_kv_heads=heads, head_size=8, block_size=16)


@pytest.mark.parametrize(("heads", "tp"), [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2), (2, 8)])
def test_heads_of_rank_are_the_heads_the_tp_layers_give_the_rank(heads: int, tp: int) -> None:
    for rank in range(tp):
        held = kv_heads_of_rank(heads, rank, tp)
        assert len(held) == num_kv_heads_per_rank(heads, tp)
        # The QKV projection's K rows of this rank are exactly these heads' rows.
        kv = qkv_slices(num_heads=8, num_kv_heads=heads, head_size=8, rank=rank, size=tp)[1]
        assert (kv.start, kv.size) == (held.start * 8, len(held) * 8)


def test_same_tp_reads_rank_r_from_rank_r() -> None:
    for rank in range(2):
        assert plan_head_slices(_layout(2), _layout(2), rank) == [HeadSlice(rank, 0, 0, 2)]


def test_prefill_tp2_to_decode_tp1_reads_both_halves_into_one_block() -> None:
    assert plan_head_slices(_layout(2), _layout(1), 0) == [
        HeadSlice(0, 0, 0, 2),
        HeadSlice(1, 0, 2, 2),
    ]


def test_prefill_tp1_to_decode_tp2_reads_each_ranks_slice() -> None:
    assert plan_head_slices(_layout(1), _layout(2), 0) == [HeadSlice(0, 0, 0, 2)]
    assert plan_head_slices(_layout(1), _layout(2), 1) == [HeadSlice(0, 2, 0, 2)]


def test_tp4_to_tp2_and_back() -> None:
    assert plan_head_slices(_layout(4), _layout(2), 1) == [
        HeadSlice(2, 0, 0, 1),
        HeadSlice(3, 0, 1, 1),
    ]
    assert plan_head_slices(_layout(2), _layout(4), 3) == [HeadSlice(1, 1, 0, 1)]


def test_replicated_heads_are_read_from_the_same_rank_or_the_lowest_holder() -> None:
    # 2 KV heads over 4 producer ranks: head 0 on ranks 0-1, head 1 on ranks 2-3.
    assert plan_head_slices(_layout(4, heads=2), _layout(1, heads=2), 0) == [
        HeadSlice(0, 0, 0, 1),
        HeadSlice(2, 0, 1, 1),
    ]
    # Equal TP with replicated heads: rank r still reads rank r.
    for rank in range(4):
        assert plan_head_slices(_layout(4, heads=2), _layout(4, heads=2), rank) == [
            HeadSlice(rank, 0, 0, 1)
        ]
    # TP=4 -> TP=2 with 2 heads: consumer rank 1 (head 1) reads it from producer rank 2 or 3,
    # not its own index (producer rank 1 holds head 0).
    assert plan_head_slices(_layout(4, heads=2), _layout(2, heads=2), 1) == [HeadSlice(2, 0, 0, 1)]
    # A replicated consumer rank reads its one head.
    assert plan_head_slices(_layout(1, heads=2), _layout(4, heads=2), 3) == [HeadSlice(0, 1, 0, 1)]


def test_pipeline_parallel_is_refused_naming_both_layouts() -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 1 .*producer TP=2 PP=2"):
        plan_head_slices(_layout(2, pp=2), _layout(1), 0)


def test_heads_that_do_not_divide_are_refused_naming_the_layouts() -> None:
    with pytest.raises(ValueError, match=r"not divisible .*producer TP=1 PP=1, 6 KV heads"):
        plan_head_slices(_layout(1, heads=6), _layout(4, heads=6), 0)
    with pytest.raises(ValueError, match="not a multiple"):
        plan_head_slices(_layout(1, heads=2), _layout(3, heads=2), 0)


def test_different_heads_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in num_kv_heads"):
        plan_head_slices(_layout(2, heads=4), _layout(2, heads=2), 0)


def test_layout_round_trips_and_names_a_missing_field() -> None:
    layout = _layout(2)
    assert KVLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="lacks tp_size"):
        KVLayout.from_dict({"pp_size": 1})
    with pytest.raises(ValueError, match=r"KVLayout\.tp_size"):
        KVLayout(tp_size=0, pp_size=1, num_kv_heads=1, head_size=1, block_size=1)
