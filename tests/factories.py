"""Shared test factories: requests, schedulers over tiny configs, hand-built runner outputs.

Test modules import these from here (never from a conftest), so no test depends on another
test folder's fixtures module."""

from __future__ import annotations

from typing import Any

from fleetserve.engine.config import CacheConfig, SchedulerConfig
from fleetserve.engine.core.kv_cache_utils import get_request_block_hasher
from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.core.scheduler import Scheduler
from fleetserve.engine.request import Request
from fleetserve.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_request(
    req_id: str,
    prompt_token_ids: list[int],
    max_tokens: int | None = 16,
    *,
    block_size: int = BLOCK_SIZE,
    eos_token_ids: tuple[int, ...] = (),
    arrival_time: float | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    **sampling: Any,
) -> Request:
    """A request hashed with `block_size` (greedy unless `sampling` says otherwise)."""
    sampling.setdefault("temperature", 0.0)
    return Request(
        req_id,
        prompt_token_ids,
        SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_ids=eos_token_ids,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(block_size),
    )


def make_scheduler(
    *,
    num_blocks: int = 11,
    block_size: int = BLOCK_SIZE,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 16,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    full_sequence_must_fit: bool = False,
    watermark: float = 0.0,
    send_sampled_tokens: bool = False,
) -> Scheduler:
    """A scheduler over `num_blocks` blocks (block 0 is the null block); no watermark by default."""
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
            full_sequence_must_fit=full_sequence_must_fit,
        ),
        CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            watermark=watermark,
        ),
        num_blocks,
        send_sampled_tokens=send_sampled_tokens,
    )


def runner_output(
    scheduler: Scheduler, output: SchedulerOutput, token_id: int | dict[str, int] = 7
) -> ModelRunnerOutput:
    """What a runner returns: one token for each request whose prompt is now fully computed.

    Must be called right after `schedule()` (it reads the advanced `num_computed_tokens`).
    """
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        token = token_id[req_id] if isinstance(token_id, dict) else token_id
        sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(scheduler: Scheduler, token_id: int | dict[str, int] = 7) -> SchedulerOutput:
    """One engine step with a fake runner; checks the scheduler invariants afterwards."""
    output = scheduler.schedule()
    scheduler.check_invariants()
    scheduler.update_from_output(output, runner_output(scheduler, output, token_id))
    scheduler.check_invariants()
    return output
