"""Where the scheduler calls its KV connector (the no-op one by default), and in what order.

A recording connector stands in for the real ones (issue 14): these tests pin down the seam's
contract, the calls and their arguments, not any transfer.
"""

from __future__ import annotations

from typing import Any

from fleetserve.engine.core.outputs import SchedulerOutput
from fleetserve.engine.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorScheduler,
    NoKVConnector,
)
from fleetserve.engine.request import Request, RequestStatus
from tests.factories import make_request, make_scheduler, step


class RecordingConnector(KVConnectorScheduler):
    def __init__(self, num_external: int = 0) -> None:
        self.num_external = num_external
        self.calls: list[tuple[Any, ...]] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self.calls.append(("matched", request.request_id, num_computed_tokens))
        return self.num_external, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.calls.append(("alloc", request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.calls.append(("meta", sorted(scheduler_output.num_scheduled_tokens)))
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("finished", request.request_id, list(block_ids)))
        return False, None


def test_default_connector_is_the_no_op_one() -> None:
    scheduler = make_scheduler()
    assert isinstance(scheduler.connector, NoKVConnector)
    scheduler.add_request(make_request("a", list(range(20)), max_tokens=1))
    output = step(scheduler)
    assert isinstance(output.kv_connector_metadata, KVConnectorMetadata)


def test_calls_in_order_with_the_local_hit_and_the_block_table() -> None:
    connector = RecordingConnector()
    scheduler = make_scheduler(num_blocks=11)
    scheduler.connector = connector
    prompt = list(range(40))  # 2 full blocks + 8 tokens
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    step(scheduler)  # prefill + the one token: "a" finishes in this step
    assert connector.calls == [
        ("matched", "a", 0),
        ("alloc", "a", [1, 2, 3], 0),
        ("meta", ["a"]),
        ("finished", "a", [1, 2, 3]),
    ]
    connector.calls.clear()
    # A repeat hits the 2 cached blocks locally: the connector is told the local hit (32).
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    step(scheduler)
    assert connector.calls[0] == ("matched", "b", 32)
    assert connector.calls[1][:2] == ("alloc", "b") and connector.calls[1][3] == 0


def test_external_tokens_count_as_computed_and_get_blocks() -> None:
    connector = RecordingConnector(num_external=16)
    scheduler = make_scheduler(num_blocks=11)
    scheduler.connector = connector
    scheduler.add_request(make_request("a", list(range(40)), max_tokens=2))
    output = scheduler.schedule()
    # 16 tokens come from the remote engine: only the other 24 are computed here, but blocks
    # are allocated for all 40 (the connector loads into the first one).
    assert output.num_scheduled_tokens == {"a": 24}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 16
    assert connector.calls[1] == ("alloc", "a", [1, 2, 3], 16)


def test_abort_tells_the_connector_before_the_blocks_are_freed() -> None:
    connector = RecordingConnector()
    scheduler = make_scheduler()
    scheduler.connector = connector
    scheduler.add_request(make_request("a", list(range(20)), max_tokens=8))
    scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert connector.calls[-1] == ("finished", "a", [1, 2])
    assert scheduler.kv_cache_manager.get_block_ids("a") == []


def test_waiting_for_remote_kv_is_a_live_state() -> None:
    assert not RequestStatus.WAITING_FOR_REMOTE_KVS.is_finished
    assert RequestStatus.WAITING_FOR_REMOTE_KVS.finish_reason is None
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
    }
