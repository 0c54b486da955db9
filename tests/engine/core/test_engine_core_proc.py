"""The engine-core process loop and wire format, with a fake core over inproc ZMQ (milliseconds)."""

from __future__ import annotations

import threading
import time
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

    def check_health(self) -> None:
        pass

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
    # NOTE: "a" must outlive the round trip to the abort however slow the machine is (a 1000-step
    # request once finished first on a loaded box, and the abort then had nothing to reach).
    to_core.send(_add("a", 10**9))
    to_core.send(_add("a", 10**9))
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


# -- isolation and backpressure (issue 13) ------------------------------------------------------


def _collect_until(
    from_core: zmq.Socket[bytes], done: str
) -> tuple[list[EngineCoreOutput], dict[str, str], int]:
    """Outputs, rejections and the last adds-processed count until request `done` finishes."""
    decoder = msgspec.msgpack.Decoder(CoreMessage)
    outputs: list[EngineCoreOutput] = []
    rejected: dict[str, str] = {}
    processed = 0
    while not any(o.req_id == done and o.finished for o in outputs):
        message = decoder.decode(from_core.recv())
        assert isinstance(message, CoreOutputs)
        outputs += message.outputs
        rejected |= message.rejected
        processed = message.num_adds_processed
    return outputs, rejected, processed


def test_any_exception_in_an_add_fails_only_that_request(
    loop_sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], FakeCore],
) -> None:
    to_core, from_core, _ = loop_sockets
    bad_params = {**SamplingParams(max_tokens=2).to_dict(), "temperature": None}  # TypeError
    to_core.send(msgspec.msgpack.encode(AddRequestMessage(
        request_id="typeerror", prompt_token_ids=[1], params=bad_params, eos_token_ids=[],
        arrival_time=0.0,
    )))  # fmt: skip
    to_core.send(msgspec.msgpack.encode({"type": "add", "request_id": "partial"}))  # fields missing
    to_core.send(b"\xc1 not msgpack at all")
    unknown_key = {**SamplingParams(max_tokens=2).to_dict(), "bogus": 1}  # ValueError
    to_core.send(msgspec.msgpack.encode(AddRequestMessage(
        request_id="valueerror", prompt_token_ids=[1], params=unknown_key, eos_token_ids=[],
        arrival_time=0.0,
    )))  # fmt: skip
    to_core.send(_add("good", 2))
    outputs, rejected, processed = _collect_until(from_core, "good")
    failed = {o.req_id: o for o in outputs if o.error is not None}
    assert set(failed) == {"typeerror", "partial"}
    assert all(o.finish_reason == "abort" and o.new_token_ids == [] for o in failed.values())
    assert failed["typeerror"].error is not None and "TypeError" in failed["typeerror"].error
    assert "unknown sampling field" in rejected["valueerror"]
    assert [o.new_token_ids for o in outputs if o.req_id == "good"] == [[7], [7]]
    assert processed == 4  # every add the core saw, refused or not (the garbage was no add)


def test_a_full_output_socket_blocks_the_core_without_losing_an_abort_or_its_parent() -> None:
    """Bounded outputs: with nobody reading, the core stops after a few messages (no memory
    growth), still notices its parent dying, and an abort sent meanwhile is applied."""
    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out.setsockopt(zmq.SNDHWM, 2)
    from_core.setsockopt(zmq.RCVHWM, 2)
    core_in.bind("inproc://in-bounded")
    to_core.connect("inproc://in-bounded")
    from_core.bind("inproc://out-bounded")
    core_out.connect("inproc://out-bounded")
    alive = threading.Event()
    alive.set()
    core = FakeCore()
    loop = _EngineLoop(core, core_in, core_out, parent_alive=alive.is_set)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        to_core.send(_add("a", 10**9))
        deadline = time.monotonic() + 5
        while core.steps < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        blocked_at = core.steps
        time.sleep(0.3)
        assert core.steps == blocked_at and blocked_at < 20, core.steps  # waiting to send
        to_core.send(msgspec.msgpack.encode(AbortMessage(request_ids=["a"])))
        # Reading again unblocks the core, which then applies the abort it was sent.
        from_core.setsockopt(zmq.RCVTIMEO, 5000)
        decoder = msgspec.msgpack.Decoder(CoreMessage)
        while not core.aborted:
            decoder.decode(from_core.recv())
        assert core.aborted == ["a"]
        # Blocked again (nobody reads, a new endless request), the parent's death ends it.
        to_core.send(_add("b", 10**9))
        time.sleep(0.5)
        alive.clear()
        thread.join(5)
        assert not thread.is_alive(), "the core kept waiting to send to a dead parent"
    finally:
        for sock in (to_core, core_in, core_out, from_core):
            sock.close(linger=0)
        ctx.term()
