"""`AsyncLLM`: the engine-core client inside the API server process (an `EngineClient`).

It spawns the EngineCore process (`engine_core_proc.run_engine_core`), sends it requests over a
ZMQ PUSH socket and reads its outputs from a PULL socket in one asyncio task, which detokenizes
them (`OutputProcessor`, DELTA mode), feeds the metrics and routes each `RequestOutput` to the
queue of the request's `generate()` generator. From the core's package it uses only the wire
messages (`core/messages.py`) and the process entry point it spawns.

Its own state is keyed by the client's request id (the parent of an `n > 1` request); the
children, their ids and which of them still wait are the `OutputProcessor`'s to know.

Guarantees:
- Leaving `generate()` before the request finished (client disconnect, handler cancelled) aborts
  it in the engine, which frees its KV blocks.
- When the core process dies, `is_healthy` turns False and every in-flight and later request
  fails with `EngineDeadError` instead of hanging.
- Admission: a request is refused with `EngineOverloadedError` while `max_waiting_requests`
  sequences already wait to be scheduled, so the engine never queues without bound.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core_proc import run_engine_core
from fleetserve.engine.core.messages import (
    AbortMessage,
    AddRequestMessage,
    CoreMessage,
    CoreOutputs,
    FailedMessage,
    InputMessage,
    ReadyMessage,
    ShutdownMessage,
    StopMessage,
)
from fleetserve.engine.engine_client import EngineDeadError, EngineOverloadedError
from fleetserve.engine.metrics import EngineMetrics, StatsLogger
from fleetserve.engine.output_processor import OutputKind, OutputProcessor
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.tokenizer import eos_token_ids, load_tokenizer
from fleetserve.engine.validation import validate_prompt

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from transformers import PreTrainedTokenizerBase

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError"]

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """API-side bookkeeping of one live request (by the client's id): its output queue and
    the timeline its latency metrics come from."""

    num_prompt_tokens: int
    arrival_time: float
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    last_token_time: float | None = None


class AsyncLLM:
    """Asyncio client of one EngineCore process; create, `await start()`, `await shutdown()`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        metrics: EngineMetrics,
        max_waiting_requests: int,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.stats_logger = StatsLogger()
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.model)
        self.eos_token_ids = eos_token_ids(
            config.model.model, config.model.hf_config, self.tokenizer
        )
        self._processor = OutputProcessor(self.tokenizer)
        self._requests: dict[str, _RequestState] = {}
        self._dead = False
        self._proc: BaseProcess | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="fleetserve-zmq-")
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never drop or block an abort
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._output_task: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> None:
        """Spawn the core process and wait until its model is loaded.

        Raises:
            RuntimeError: the core failed to start (its error text) or timed out.
        """
        input_address = f"ipc://{self._tmpdir}/input"
        output_address = f"ipc://{self._tmpdir}/output"
        self._input.bind(input_address)
        self._output.bind(output_address)
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self.config, input_address, output_address),
            name="fleetserve-engine-core",
            daemon=True,
        )
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine core did not start within {timeout_s:.0f} s")
            if await self._output.poll(200):
                message = self._decoder.decode(await self._output.recv())
                if isinstance(message, FailedMessage):
                    raise RuntimeError(f"engine core failed to start: {message.error}")
                assert isinstance(message, ReadyMessage), f"unexpected first message {message!r}"
                break
            if not self._proc.is_alive():
                raise RuntimeError(f"engine core exited with code {self._proc.exitcode} at start")
        loop = asyncio.get_running_loop()
        loop.add_reader(self._proc.sentinel, self._on_core_exit)
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-core-outputs")
        logger.info("engine core process %d ready", message.pid)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core process (politely, then by force) and release the sockets."""
        proc = self._proc
        if proc is not None:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
            if proc.is_alive():
                self._send(ShutdownMessage())
                await asyncio.to_thread(proc.join, timeout_s)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, timeout_s)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._dead = True
        if self._output_task is not None:
            self._output_task.cancel()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        return not self._dead and self._proc is not None and self._proc.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._processor.num_unscheduled

    # -- requests -----------------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        admit: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request now; the returned iterator yields its DELTA outputs until `finished`.

        Validation and admission happen before this returns, so a caller can still answer
        with an HTTP error. Admission is decided once per client request: the later prompts of
        a batch pass `admit=False`, so a batch is admitted or refused as a whole. Leaving the
        iteration early aborts the request; callers that might never start iterating should
        call `abort(request_id)` in a `finally` (a no-op once done).

        Raises:
            ValueError: the prompt or params are invalid for this engine.
            EngineOverloadedError: too many sequences wait already (nothing was added).
            EngineDeadError: the core process is gone (also raised by the iterator mid-way).
        """
        if admit:
            self.check_admission()
        elif not self.is_healthy:
            raise EngineDeadError("the engine core process is not running")
        validate_prompt(prompt_token_ids, params, self.config)
        state = self._add(request_id, prompt_token_ids, params, prompt, priority, cache_salt)
        return self._stream(request_id, state)

    async def _stream(self, request_id: str, state: _RequestState) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # whoever failed it has forgotten it already
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def check_admission(self) -> None:
        """Raise when the engine cannot take another request now (dead or overloaded)."""
        if not self.is_healthy:
            raise EngineDeadError("the engine core process is not running")
        if self.num_waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.num_waiting} requests are waiting "
                f"(max_waiting_requests={self.max_waiting_requests}); retry later",
                retry_after_s=1,
            )

    def abort(self, request_id: str) -> None:
        """Forget a request and abort its sequences in the core (no-op when unknown)."""
        self._requests.pop(request_id, None)
        child_ids = self._processor.abort_request(request_id)
        if child_ids and not self._dead:
            self._send(AbortMessage(request_ids=child_ids))

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        priority: int,
        cache_salt: str | None,
    ) -> _RequestState:
        arrival_time = time.monotonic()
        children = self._processor.add_request(
            request_id, prompt, prompt_token_ids, params, kind=OutputKind.DELTA
        )
        state = _RequestState(len(prompt_token_ids), arrival_time)
        self._requests[request_id] = state
        for child_id, child_params in children.items():
            self._send(
                AddRequestMessage(
                    request_id=child_id,
                    prompt_token_ids=prompt_token_ids,
                    params=child_params.to_dict(),
                    eos_token_ids=list(self.eos_token_ids),
                    arrival_time=arrival_time,
                    priority=priority,
                    cache_salt=cache_salt,
                )
            )
        return state

    def _send(self, message: InputMessage) -> None:
        self._input.send(self._encoder.encode(message))

    # -- outputs ------------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            message = self._decoder.decode(await self._output.recv())
            if isinstance(message, CoreOutputs):
                self._handle_outputs(message)
            else:
                logger.warning("ignoring unexpected engine core message %r", message)

    def _handle_outputs(self, message: CoreOutputs) -> None:
        now = time.monotonic()
        self.metrics.record_scheduler_stats(message.stats)
        self.stats_logger.last_stats = message.stats
        for child_id, error in message.rejected.items():
            parent_id = self._processor.parent_id_of(child_id)
            if parent_id is not None:
                self._fail(parent_id, ValueError(error))
        for child_id, scheduled_time in message.scheduled_times.items():
            parent_id = self._processor.record_scheduled(child_id)
            state = self._requests.get(parent_id) if parent_id is not None else None
            if state is not None:
                self.metrics.request_queue_time.observe(
                    max(0.0, scheduled_time - state.arrival_time)
                )
        if not message.outputs:
            return
        processed = self._processor.process_outputs(message.outputs)
        if processed.reqs_to_finish:
            self._send(StopMessage(request_ids=processed.reqs_to_finish))
        for output in processed.request_outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue
            self._record_output(state, output, now)
            state.queue.put_nowait(output)
            if output.finished:
                del self._requests[output.request_id]

    def _record_output(self, state: _RequestState, output: RequestOutput, now: float) -> None:
        metrics = self.metrics
        num_new = sum(len(c.token_ids) for c in output.outputs)
        if num_new:
            if state.first_token_time is None:
                state.first_token_time = now
                metrics.time_to_first_token.observe(now - state.arrival_time)
                metrics.prompt_tokens.inc(state.num_prompt_tokens)
                self.stats_logger.record_tokens(state.num_prompt_tokens, 0)
            elif state.last_token_time is not None:
                metrics.inter_token_latency.observe(now - state.last_token_time)
            state.last_token_time = now
            metrics.generation_tokens.inc(num_new)
            self.stats_logger.record_tokens(0, num_new)
        if output.finished:
            metrics.e2e_request_latency.observe(now - state.arrival_time)

    def _fail(self, request_id: str, error: BaseException) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        self.abort(request_id)
        state.queue.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        requests, self._requests = self._requests, {}
        for request_id, state in requests.items():
            self._processor.abort_request(request_id)
            state.queue.put_nowait(error)

    def _on_core_exit(self) -> None:
        assert self._proc is not None, "core exit callback without a process"
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        # NOTE: the sentinel fires as the process closes its fds, a moment before it can be
        # reaped; a short join gets the exit code for the log.
        self._proc.join(1.0)
        logger.error("engine core process exited (code %s)", self._proc.exitcode)
        self._dead = True
        self._fail_all(EngineDeadError("the engine core process died"))
        if self._output_task is not None:
            self._output_task.cancel()
