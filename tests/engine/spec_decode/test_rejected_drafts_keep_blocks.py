"""Rejecting every draft leaves the target's KV blocks as they were (seed notes part 3 §2.5).

A proposer that is always wrong runs next to a plain engine, step for step, over the same
requests. After every step each request has the plain run's tokens, computed count and block
hashes; the prefix cache indexes exactly the plain run's hashes (never a draft's); the blocks
holding committed tokens are the ones the request held before the step, and their KV bytes are
bit-for-bit unchanged (the verification pass wrote only past them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.request import Request
from fleetserve.engine.sampling_params import SamplingParams
from tests.engine.spec_decode.helpers import OracleProposer, spec_decoder
from tests.engine.tiny_models import make_prompts

K = 3
BLOCK_SIZE = 4
MAX_TOKENS = 14
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _core(model: Path, **overrides: Any) -> EngineCore:
    args: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "num_kv_blocks": 400,
        "block_size": BLOCK_SIZE,
        "max_model_len": 256,
        # NOTE: compared step for step with the speculative (synchronous) engine.
        "async_scheduling": False,
    }
    return EngineCore(EngineConfig.create(str(model), **args, **overrides))


def _committed_kv(core: EngineCore, request: Request) -> torch.Tensor:
    """The KV bytes of the request's computed positions, every layer (a copy)."""
    executor: Any = core.executor
    caches = executor.worker.model_runner.kv_caches
    block_ids = core.scheduler.kv_cache_manager.get_block_ids(request.request_id)
    positions = torch.arange(request.num_computed_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // BLOCK_SIZE]
    offsets = positions % BLOCK_SIZE
    return torch.stack([cache[:, blocks, offsets].clone() for cache in caches])


def _cached_hashes(core: EngineCore) -> set[Any]:
    pool = core.scheduler.kv_cache_manager.block_pool
    return {block_hash for block_hash, _ in pool.cached_block_hash_to_block.items()}


@pytest.mark.parametrize("num_prompts", [1, 5])
def test_rejecting_every_draft_leaves_target_blocks_unchanged(
    tiny_llama_dir: Path, num_prompts: int
) -> None:
    plain = _core(tiny_llama_dir)
    spec = _core(
        tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": K}
    )
    prompts = make_prompts(512, [9, 14, 3, 22, 6][:num_prompts], seed=5)
    for i, prompt in enumerate(prompts):
        plain.add_request(f"r{i}", prompt, PARAMS, eos_token_ids=(2,))
    # The plain run's full outputs: the always-wrong oracle proposes something else each time.
    references: list[list[int]] = [list(p) for p in prompts]
    shadow = _core(tiny_llama_dir)
    for i, prompt in enumerate(prompts):
        shadow.add_request(f"r{i}", prompt, PARAMS, eos_token_ids=(2,))
    while shadow.has_unfinished_requests():
        for output in shadow.step():
            references[int(output.req_id[1:])] += output.new_token_ids
    oracle = OracleProposer(references, K, 512)
    spec_decoder(spec).history_proposer = oracle
    for i, prompt in enumerate(prompts):
        spec.add_request(f"r{i}", prompt, PARAMS, eos_token_ids=(2,))

    num_verified_steps = 0
    while plain.has_unfinished_requests():
        live = list(spec.scheduler.requests.values())
        before = {r.request_id: _committed_kv(spec, r) for r in live if r.num_computed_tokens}
        blocks_before = {
            r.request_id: spec.scheduler.kv_cache_manager.get_block_ids(r.request_id) for r in live
        }
        plain.step()
        spec.step()
        stats = spec.scheduler.make_stats().spec_decoding
        assert stats is not None and stats.num_accepted_tokens == 0
        num_verified_steps += stats.num_drafts > 0
        assert sorted(spec.scheduler.requests) == sorted(plain.scheduler.requests)
        for req_id, request in spec.scheduler.requests.items():
            reference = plain.scheduler.requests[req_id]
            assert request.all_token_ids == reference.all_token_ids
            assert request.num_computed_tokens == reference.num_computed_tokens
            assert request.block_hashes == reference.block_hashes
            if req_id in before:
                old = before[req_id]
                num_old = old.shape[2]
                num_blocks = -(-num_old // BLOCK_SIZE)
                block_ids = spec.scheduler.kv_cache_manager.get_block_ids(req_id)
                assert block_ids[:num_blocks] == blocks_before[req_id][:num_blocks]
                assert torch.equal(_committed_kv(spec, request)[:, :, :num_old], old)
        assert _cached_hashes(spec) == _cached_hashes(plain)
        spec.scheduler.check_invariants()
    assert not spec.has_unfinished_requests()
    stats = spec.scheduler.make_stats().spec_decoding
    assert stats is not None and stats.num_draft_tokens > 0 and num_verified_steps > 3
    if num_prompts == 1:
        # One request: the rejected drafts' lookahead blocks are reused, so it ends holding the
        # very blocks the plain run allocated.
        assert spec.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == (
            plain.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        )
