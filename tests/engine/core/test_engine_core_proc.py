"""The engine-core process loop and wire format, with a fake core over inproc ZMQ (milliseconds)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq

from fleetserve.engine.core.engine_core_proc import _EngineLoop
from fleetserve.engine.core.messages import (
    AbortMessage,
    AddRequestMessage,
    CoreMessage,
    CoreOutputs,
    InputMessage,
    ShutdownMessage,
)
from fleetserve.engine.core.outputs import EngineCoreOutput, LogprobsLists, SchedulerStats
from fleetserve.engine.sampling_params import SamplingParams


@dataclass
class _FakeRequest:
    request_id: str
    max_tokens: int
    produced: int = 0


@dataclass
class _FakeScheduler:
    running: list[_FakeRequest] = field(default_factory=list)


class FakeCore:
    """Emits token 7 for every running request each step; finishes at max_tokens."""

    def __init__(self) -> None:
        self.scheduler = _FakeScheduler()
        self.aborted: list[str] = []
        self.steps = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    **_: object) -> None:  # fmt: skip
        if request_id in {r.request_id for r in self.scheduler.running}:
            raise ValueError(f"request_id {request_id!r} is already in use")
        assert params.max_tokens is not None
        self.scheduler.running.append(_FakeRequest(request_id, params.max_tokens))

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted.extend(ids)
        self.scheduler.running = [r for r in self.scheduler.running if r.request_id not in ids]

    stop_requests = abort_requests

    def step(self) -> list[EngineCoreOutput]:
        self.steps += 1
        outputs = []
        for request in list(self.scheduler.running):
            request.produced += 1
            done = request.produced >= request.max_tokens
            outputs.append(
                EngineCoreOutput(request.request_id, [7], finish_reason="length" if done else None)
            )
            if done:
                self.scheduler.running.remove(request)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.scheduler.running), kv_cache_usage=0.5)


@pytest.fixture
def loop_sockets() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes], FakeCore]]:
    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_in.bind("inproc://in")
    to_core.connect("inproc://in")
    from_core.bind("inproc://out")
    core_out.connect("inproc://out")
    from_core.setsockopt(zmq.RCVTIMEO, 5000)
    core = FakeCore()
    thread = threading.Thread(target=_EngineLoop(core, core_in, core_out).run, daemon=True)
    thread.start()
    yield to_core, from_core, core
    to_core.send(msgspec.msgpack.encode(ShutdownMessage()))
    thread.join(5)
    assert not thread.is_alive(), "the loop did not stop on ShutdownMessage"
    for sock in (to_core, core_in, core_out, from_core):
        sock.close(linger=0)
    ctx.term()


def _add(request_id: str, max_tokens: int) -> bytes:
    message: InputMessage = AddRequestMessage(
        request_id=request_id, prompt_token_ids=[1, 2], eos_token_ids=[], arrival_time=0.0,
        params=SamplingParams(max_tokens=max_tokens).to_dict(),
    )  # fmt: skip
    return msgspec.msgpack.encode(message)


def test_loop_streams_outputs_with_stats_and_scheduled_times(
    loop_sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], FakeCore],
) -> None:
    to_core, from_core, _ = loop_sockets
    decoder = msgspec.msgpack.Decoder(CoreMessage)
    to_core.send(_add("a", 2))
    first = decoder.decode(from_core.recv())
    assert isinstance(first, CoreOutputs)
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in first.outputs] == [
        ("a", [7], None)
    ]
    assert list(first.scheduled_times) == ["a"]
    assert first.stats == SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5)
    second = decoder.decode(from_core.recv())
    assert isinstance(second, CoreOutputs)
    assert [(o.req_id, o.finish_reason) for o in second.outputs] == [("a", "length")]
    assert second.scheduled_times == {}


def test_duplicate_add_is_rejected_and_abort_reaches_the_core(
    loop_sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], FakeCore],
) -> None:
    to_core, from_core, core = loop_sockets
    decoder = msgspec.msgpack.Decoder(CoreMessage)
    to_core.send(_add("a", 1000))
    to_core.send(_add("a", 1000))
    rejected: dict[str, str] = {}
    while not rejected:
        message = decoder.decode(from_core.recv())
        assert isinstance(message, CoreOutputs)
        rejected = message.rejected
    assert "already in use" in rejected["a"]
    to_core.send(msgspec.msgpack.encode(AbortMessage(request_ids=["a"])))
    while True:
        message = decoder.decode(from_core.recv())
        assert isinstance(message, CoreOutputs)
        if message.stats.num_running_reqs == 0:
            break
    assert core.aborted == ["a"]


def test_outputs_with_logprobs_round_trip() -> None:
    message = CoreOutputs(
        outputs=[EngineCoreOutput("x", [3, 4], LogprobsLists([[3, 1]], [[-0.1, -2.5]], [1]),
                                  finish_reason="stop", stop_reason=4, num_cached_tokens=16)],
        stats=SchedulerStats(2, 1, 0.25, 64, 32, 1),
        scheduled_times={"x": 12.5},
    )  # fmt: skip
    decoded = msgspec.msgpack.Decoder(CoreMessage).decode(msgspec.msgpack.encode(message))
    assert decoded == message
