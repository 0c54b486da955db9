"""The scheduler's invariants as assertions: every test step checks them, so a broken one fails
at the step that broke it (seed notes part 1 §2.8: each live request is in exactly one place)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleetserve.engine.request import RequestStatus

if TYPE_CHECKING:
    from fleetserve.engine.core.scheduler import Scheduler

__all__ = ["check_scheduler_invariants"]


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    """Assert the container and KV invariants of `scheduler` (cheap: tests run it every step)."""
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    parked_ids = list(scheduler.remote_kv.parked) + list(scheduler.structured_output.waiting)
    assert len(set(running_ids)) == len(running_ids), "a request is twice in running"
    assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
    assert sorted(running_ids + waiting_ids + parked_ids) == sorted(scheduler.requests), (
        "running + waiting + parked differ from the live requests"
    )
    for compiling in scheduler.structured_output.waiting.values():
        assert compiling.status == RequestStatus.WAITING_FOR_GRAMMAR, compiling
    for parked in scheduler.remote_kv.parked.values():
        assert parked.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, parked
    assert not set(scheduler.remote_kv.held) & set(scheduler.requests), "a live request is held"
    assert len(scheduler.running) <= scheduler.config.max_num_seqs, "more running than max_num_seqs"
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING, f"{request} in running"
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
            f"{request} in waiting"
        )
        # NOTE: only a request resumed after a remote load waits with blocks (its computed
        # tokens are in them).
        owned = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        assert not owned or request.num_computed_tokens > 0, f"waiting {request} owns blocks"
        assert len(owned) * scheduler.block_size >= request.num_computed_tokens, request
    scheduler.kv_cache_manager.block_pool.check_integrity()
