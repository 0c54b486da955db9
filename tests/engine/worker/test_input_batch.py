"""The persistent batch keeps rows across steps and condenses holes by moving the last rows."""

from __future__ import annotations

import pytest

from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.worker.input_batch import CachedRequestState, InputBatch


def _state(req_id: str, prompt: list[int], blocks: list[int]) -> CachedRequestState:
    return CachedRequestState(req_id, prompt, [], SamplingParams(), None, blocks, 0)


def test_add_remove_condense_moves_last_rows_into_holes() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=8, max_num_blocks_per_req=2)
    for i, req_id in enumerate("abcd"):
        assert batch.add_request(_state(req_id, [i, i + 10], [i + 1])) == i
    batch.remove_request("a")
    batch.remove_request("c")
    batch.condense()
    assert batch.req_ids == ["d", "b", None, None]
    assert batch.req_id_to_index == {"d": 0, "b": 1}
    assert batch.token_ids[0, :2].tolist() == [3, 13]
    assert batch.block_table[0, :1].tolist() == [4]
    assert batch.add_request(_state("e", [7], [9, 10])) == 2
    assert batch.block_table[2].tolist() == [9, 10]


def test_tokens_and_blocks_append_in_place() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=4, max_num_blocks_per_req=2)
    batch.add_request(_state("a", [1, 2], [5]))
    batch.set_tokens("a", 2, [3])
    batch.append_block_ids("a", [6])
    assert batch.token_ids[0, :3].tolist() == [1, 2, 3] and batch.num_tokens[0] == 3
    assert batch.block_table[0].tolist() == [5, 6]
    with pytest.raises(ValueError, match="max_model_len is 4"):
        batch.set_tokens("a", 3, [4, 5])


def test_full_batch_and_duplicate_ids_are_rejected() -> None:
    batch = InputBatch(max_num_reqs=1, max_model_len=4, max_num_blocks_per_req=1)
    batch.add_request(_state("a", [1], [1]))
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request(_state("a", [1], [1]))
    with pytest.raises(ValueError, match="max_num_seqs=1"):
        batch.add_request(_state("b", [1], [1]))


def test_a_steps_sampled_tokens_land_in_one_write_as_set_tokens_would() -> None:
    batch = InputBatch(max_num_reqs=3, max_model_len=4, max_num_blocks_per_req=1)
    for req_id, prompt in (("a", [1, 2]), ("b", [3]), ("c", [4, 5, 6])):
        batch.add_request(_state(req_id, prompt, [1]))
    expected = InputBatch(max_num_reqs=3, max_model_len=4, max_num_blocks_per_req=1)
    for req_id, prompt in (("a", [1, 2]), ("b", [3]), ("c", [4, 5, 6])):
        expected.add_request(_state(req_id, prompt, [1]))
    expected.set_tokens("c", 3, [9])
    expected.set_tokens("a", 2, [7])
    batch.set_last_tokens([2, 0], [3, 2], [9, 7])
    assert batch.token_ids.tolist() == expected.token_ids.tolist()
    assert batch.num_tokens.tolist() == expected.num_tokens.tolist() == [3, 1, 4]
    batch.set_last_tokens([], [], [])  # a step that samples nothing
    with pytest.raises(ValueError, match="reaches max_model_len=4"):
        batch.set_last_tokens([1, 2], [1, 4], [8, 8])
    assert batch.token_ids[1, 1] == 0 and batch.num_tokens[1] == 1  # nothing written
