"""`AsyncLLM`: the engine-core client inside the API server process (an `EngineClient`).

It spawns the EngineCore process (`engine_core_proc.run_engine_core`), sends it requests over a
ZMQ PUSH socket and reads its outputs from a PULL socket in one asyncio task, which detokenizes
them (`OutputProcessor`, DELTA mode), feeds the metrics and routes each `RequestOutput` to the
queue of the request's `generate()` generator. From the core's package it uses only the wire
messages (`core/messages.py`) and the process entry point it spawns.

Its own state is keyed by the caller's request id (the parent of an `n > 1` request), which
must be unique among live requests (the server makes its own; a client's id is never one); the
children, their ids and which of them still wait are the `OutputProcessor`'s to know.

Guarantees:
- Leaving `generate()` before the request finished (client disconnect, handler cancelled) aborts
  it in the engine, which frees its KV blocks.
- When the core process dies, or this process's output task fails, `is_healthy` turns False
  and every in-flight and later request fails with `EngineDeadError` instead of hanging.
- A failure that concerns one request (the core failed or refused it, its output could not be
  processed, its reader fell `max_pending_outputs` behind) ends that request only, with
  `EngineRequestError`, `RequestRejectedError` or `SlowReaderError`.
- Admission: sequences are admitted all or nothing while the waiting ones (the core's own count,
  preempted requests included, plus the adds on their way to it) stay within
  `max_waiting_requests`; beyond it `EngineOverloadedError`.
- Nothing here blocks the event loop: sends never wait (see `engine_core_proc` on why the input
  direction is unbounded) and a core that is gone is noticed, not waited for.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter

from fleetserve.common.metric_names import ENGINE_LABEL, MODEL_NAME_LABEL
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core_proc import OUTPUT_HWM, run_engine_core
from fleetserve.engine.core.messages import (
    AbortMessage,
    AddRequestMessage,
    CoreMessage,
    CoreOutputs,
    DPWaveMessage,
    FailedMessage,
    InputMessage,
    ReadyMessage,
    ShutdownMessage,
    StartWaveMessage,
    StopMessage,
)
from fleetserve.engine.distributed.data_parallel import DPCoreSpec
from fleetserve.engine.engine_client import (
    DEFAULT_MAX_PENDING_OUTPUTS,
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
    RequestRejectedError,
    SlowReaderError,
    check_waiting_bound,
)
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.metrics import EngineMetrics, StatsLogger
from fleetserve.engine.output_processor import OutputKind, OutputProcessor
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from fleetserve.engine.tokenizer import eos_token_ids, load_tokenizer
from fleetserve.engine.validation import KVCapacity, validate_prompt, validate_without_tokenizer

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError"]

logger = logging.getLogger(__name__)

SLOW_READER_ABORTS = "fleetserve:slow_reader_aborts"
"""Counter (exported as `..._total`): requests aborted because their reader fell behind."""


def slow_reader_counter(registry: CollectorRegistry | None, *, per_engine: bool) -> Counter:
    """The `SLOW_READER_ABORTS` family in `registry` (a private one when None), labelled
    `model_name` (+ `engine`, the data-parallel rank, when `per_engine`)."""
    labels = [MODEL_NAME_LABEL, ENGINE_LABEL] if per_engine else [MODEL_NAME_LABEL]
    return Counter(
        SLOW_READER_ABORTS,
        "Requests aborted because their client read the outputs too slowly.",
        labels,
        registry=registry if registry is not None else CollectorRegistry(),
    )


@dataclass
class _RequestState:
    """API-side bookkeeping of one live request (by the caller's id): its output queue and
    the timeline its latency metrics come from."""

    num_prompt_tokens: int
    arrival_time: float
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    last_token_time: float | None = None


class AsyncLLM:
    """Asyncio client of one EngineCore process; create, `await start()`, `await shutdown()`.

    Args:
        registry: where its own `fleetserve:*` metrics go (the engine's are in `metrics`).
        max_pending_outputs: a request whose reader leaves this many outputs unread is
            aborted with `SlowReaderError` (bounds the memory a stalled client can hold).
        skip_tokenizer_init: load no tokenizer; token-id prompts and outputs only.
        data_parallel: this client drives one rank of a data-parallel engine (`DPAsyncLLM`),
            which its core is told; `on_wave` gets the core's wave messages, `on_dead` the
            reason once this engine is dead, and `slow_reader_aborts` is the (rank's) counter
            to count into instead of registering one in `registry`.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        metrics: EngineMetrics,
        max_waiting_requests: int,
        registry: CollectorRegistry | None = None,
        max_pending_outputs: int = DEFAULT_MAX_PENDING_OUTPUTS,
        skip_tokenizer_init: bool = False,
        data_parallel: DPCoreSpec | None = None,
        on_wave: Callable[[DPWaveMessage], None] | None = None,
        on_dead: Callable[[str], None] | None = None,
        slow_reader_aborts: Any = None,
    ) -> None:
        if max_pending_outputs < 1:
            raise ValueError(f"max_pending_outputs must be >= 1, got {max_pending_outputs}")
        self.config = config
        self.metrics = metrics
        self.stats_logger = StatsLogger()
        self.max_waiting_requests = max_waiting_requests
        self.max_pending_outputs = max_pending_outputs
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model.model)
        self.eos_token_ids = eos_token_ids(
            config.model.model, config.model.hf_config, self.tokenizer
        )
        self.kv_capacity: KVCapacity | None = None
        """Reported by the core when it is ready."""
        self.kv_connector: dict[str, Any] | None = None
        """With a KV connector: how peers reach it (from the core's ready message)."""
        self._slow_reader_aborts = (
            slow_reader_aborts
            if slow_reader_aborts is not None
            else slow_reader_counter(registry, per_engine=False).labels(metrics.model_name)
        )
        self.data_parallel = data_parallel
        self._on_wave = on_wave
        self._on_dead = on_dead
        self._processor = OutputProcessor(self.tokenizer)
        self._requests: dict[str, _RequestState] = {}
        self._num_adds_sent = 0
        self._num_adds_processed = 0
        self._core_waiting = 0
        self._dead_reason: str | None = None
        self._proc: BaseProcess | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="fleetserve-zmq-")
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # bounded by admission (engine_core_proc)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, OUTPUT_HWM)
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
            args=(self.config, input_address, output_address, self.data_parallel),
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
        self.kv_capacity = KVCapacity(message.num_kv_blocks, message.block_size)
        self.kv_connector = message.kv_connector
        loop = asyncio.get_running_loop()
        loop.add_reader(self._proc.sentinel, self._on_core_exit)
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-core-outputs")
        self._output_task.add_done_callback(self._on_output_task_done)
        logger.info(
            "engine core process %d ready (KV cache: %d tokens)",
            message.pid,
            self.kv_capacity.num_tokens,
        )

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core process (politely, then by force) and release the sockets."""
        proc = self._proc
        self._dead_reason = self._dead_reason or "the server is shutting down"
        if proc is not None:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
            if proc.is_alive():
                self._send(ShutdownMessage())
                await asyncio.to_thread(proc.join, timeout_s)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, timeout_s)
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._output_task is not None:
            self._output_task.cancel()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        task = self._output_task
        return (
            self._dead_reason is None
            and self._proc is not None
            and self._proc.is_alive()
            and task is not None
            and not task.done()
        )

    @property
    def core_pid(self) -> int | None:
        """The core process's id (None before `start`)."""
        return None if self._proc is None else self._proc.pid

    @property
    def num_waiting(self) -> int:
        # NOTE: the core's count is a snapshot taken after it had processed
        # `_num_adds_processed` adds; the rest of what was sent is still on its way.
        return self._core_waiting + self._num_adds_sent - self._num_adds_processed

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
        kv_transfer_params: dict[str, Any] | None = None,
        admit: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request now; the returned iterator yields its DELTA outputs until `finished`.

        See `EngineClient.generate` for the contract. Besides `validate_prompt` (with the
        core's KV capacity), whole-vocabulary logprobs (-1) are refused here: they would
        decode the vocabulary on the event loop for every token.
        """
        if admit:
            self.check_admission(params.n)
        elif not self.is_healthy:
            raise self._dead_error()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) == -1:
                raise ValueError(
                    f"{name} must be in [0, {MAX_LOGPROBS}] when served; -1 (the whole "
                    "vocabulary) is for the offline LLM only"
                )
        validate_prompt(prompt_token_ids, params, self.config, self.kv_capacity)
        if self.tokenizer is None:
            validate_without_tokenizer(params)
        if lora_request is not None and self.config.lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora")
        state = self._add(
            request_id,
            prompt_token_ids,
            params,
            prompt,
            priority,
            cache_salt,
            kv_transfer_params,
            lora_request,
        )
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

    def check_admission(self, num_sequences: int = 1) -> None:
        """Raise unless `num_sequences` more sequences may wait now (see `EngineClient`)."""
        if not self.is_healthy:
            raise self._dead_error()
        check_waiting_bound(self.num_waiting, num_sequences, self.max_waiting_requests)

    def abort(self, request_id: str) -> None:
        """Forget a request and abort its sequences in the core (no-op when unknown)."""
        self._requests.pop(request_id, None)
        child_ids = self._processor.abort_request(request_id)
        if child_ids:
            self._send(AbortMessage(request_ids=child_ids))

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        priority: int,
        cache_salt: str | None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> _RequestState:
        arrival_time = time.monotonic()
        children = self._processor.add_request(
            request_id, prompt, prompt_token_ids, params, kind=OutputKind.DELTA
        )
        state = _RequestState(len(prompt_token_ids), arrival_time)
        self._requests[request_id] = state
        for child_id, child_params in children.items():
            self._num_adds_sent += 1
            self._send(
                AddRequestMessage(
                    request_id=child_id,
                    prompt_token_ids=prompt_token_ids,
                    params=child_params.to_dict(),
                    eos_token_ids=list(self.eos_token_ids),
                    arrival_time=arrival_time,
                    priority=priority,
                    cache_salt=cache_salt,
                    kv_transfer_params=kv_transfer_params,
                    lora_request=lora_request,
                )
            )
        return state

    def _send(self, message: InputMessage) -> None:
        if self._proc is None or not self._proc.is_alive():
            return  # nobody to tell (and a PUSH without a peer would block)
        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            # NOTE: the input is unbounded, so this means no peer: the core is gone. Its exit
            # callback fails the requests; the event loop must not wait for it here.
            logger.error("the engine core is not connected; dropped %s", type(message).__name__)

    # -- outputs ------------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                message = self._decoder.decode(await self._output.recv())
                if isinstance(message, CoreOutputs):
                    self._handle_outputs(message)
                elif isinstance(message, DPWaveMessage) and self._on_wave is not None:
                    self._on_wave(message)
                else:
                    logger.warning("ignoring unexpected engine core message %r", message)
                # NOTE: a recv that is ready returns without yielding; let the readers drain
                # their queues between messages, or a burst would count them as slow.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("the engine's output task failed; failing every request")
            self._die(f"the engine's output processing failed ({type(exc).__name__}: {exc})")

    def _handle_outputs(self, message: CoreOutputs) -> None:
        now = time.monotonic()
        self._core_waiting = message.stats.num_waiting_reqs
        self._num_adds_processed = message.num_adds_processed
        self.metrics.record_scheduler_stats(message.stats)
        self.stats_logger.last_stats = message.stats
        for child_id, error in message.rejected.items():
            parent_id = self._processor.parent_id_of(child_id)
            if parent_id is not None:
                self._fail(parent_id, RequestRejectedError(error))
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
        if processed.reqs_to_abort:
            self._send(AbortMessage(request_ids=processed.reqs_to_abort))
        for parent_id, error in processed.failed.items():
            self._fail(parent_id, EngineRequestError(f"the engine failed the request: {error}"))
        for output in processed.request_outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue
            self._record_output(state, output, now)
            if state.queue.qsize() >= self.max_pending_outputs and not output.finished:
                self._slow_reader_aborts.inc()
                logger.warning("aborting %s: its reader is too slow", output.request_id)
                self._fail(
                    output.request_id,
                    SlowReaderError(
                        f"the client read too slowly: {self.max_pending_outputs} outputs were "
                        "waiting to be sent, so the request was aborted"
                    ),
                )
                continue
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

    def start_wave(self, wave: int) -> None:
        """Lockstep data parallel: tell the core to run wave `wave` (see `DPAsyncLLM`)."""
        self._send(StartWaveMessage(wave=wave))

    def kill(self, reason: str) -> None:
        """End this engine now: every request fails with `EngineDeadError(reason)` and the
        core is told to stop (a data-parallel engine whose other rank died)."""
        self._die(reason)

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End one request with `error`: forget it, abort it in the core, wake its reader."""
        state = self._requests.get(request_id)
        self.abort(request_id)
        if state is not None:
            state.queue.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        requests, self._requests = self._requests, {}
        for request_id, state in requests.items():
            self._processor.abort_request(request_id)
            state.queue.put_nowait(error)

    def _dead_error(self) -> EngineDeadError:
        reason = self._dead_reason or "the engine core process is not running"
        return EngineDeadError(reason)

    def _die(self, reason: str) -> None:
        """The engine cannot serve any more: fail everything and stop the core."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._fail_all(EngineDeadError(reason))
        self._send(ShutdownMessage())  # it would compute for nobody
        if self._on_dead is not None:
            self._on_dead(reason)

    def _on_output_task_done(self, task: asyncio.Task[None]) -> None:
        if self._dead_reason is None:
            self._die("the engine's output task ended")

    def _on_core_exit(self) -> None:
        assert self._proc is not None, "core exit callback without a process"
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        self._die("the engine core process died")
        if self._output_task is not None:
            self._output_task.cancel()
        # NOTE: the sentinel fires as the process closes its fds, a moment before it can be
        # reaped; the exit code is logged from a thread so the event loop never waits for it.
        proc = self._proc
        asyncio.get_running_loop().run_in_executor(None, self._log_exit, proc)

    @staticmethod
    def _log_exit(proc: BaseProcess) -> None:
        proc.join(5.0)
        logger.error("engine core process exited (code %s)", proc.exitcode)
