"""The EngineCore in its own process, behind two ZMQ sockets carrying msgpack (msgspec).

Lifecycle (ARCHITECTURE.md §1):

1. The API server binds a PUSH socket (requests in) and a PULL socket (outputs out) and spawns
   `run_engine_core` with the "spawn" start method (torch and fork do not mix).
2. The core process connects, builds the `EngineCore` (loads the model) and sends `ReadyMessage`
   with its real KV capacity (or `FailedMessage` with the error text, then exits). The messages
   are in `messages.py`.
3. Busy loop: drain the input socket (adds, aborts, stops; non-blocking while there is work, a
   blocking poll when idle), run one `step()`, and send the step's outputs together with the
   scheduler's stats, the first-scheduled times of requests that started running and how many
   adds it has processed.
4. `ShutdownMessage`, the parent's death, a crash in `step()` or a failed `check_health()` (a
   worker process died; checked every iteration, at least every `IDLE_POLL_MS` while idle) ends
   the loop; the API server notices the dead process (its /health fails and in-flight requests
   end with an error).

One request's bad add never ends the loop: a `ValueError` rejects it (`rejected`), any other
exception, or a message that does not decode but names its request, fails it (an output with
`error`). Backpressure: the output socket holds at most `OUTPUT_HWM` messages; when the API
server stops reading, the core waits to send, checking all the while that its parent lives.
Inputs are unbounded on purpose: admission control bounds them (at most an add, a stop and an
abort per admitted sequence), and a bounded input could block the API server's event loop
while the core waits on it, a deadlock; so an abort is never dropped nor delayed by a bound.

Tokenization, detokenization and HTTP never run here, so they never stall the step loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec
import zmq

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.messages import (
    AbortMessage,
    AddRequestMessage,
    CoreOutputs,
    FailedMessage,
    InputMessage,
    ReadyMessage,
    StartWaveMessage,
    StopMessage,
)
from fleetserve.engine.core.outputs import EngineCoreOutput, SchedulerStats
from fleetserve.engine.distributed.data_parallel import DPCoreSpec
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500
"""Blocking poll when idle; also how often an idle core checks that its parent still lives."""
OUTPUT_HWM = 64
"""Step messages queued towards the API server before the core waits for it to read."""
SEND_POLL_MS = 100
"""While waiting to send: how often the core checks that its parent still lives."""


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    data_parallel: DPCoreSpec | None = None,
) -> None:
    """Process entry point: serve `config`'s engine until shutdown or the parent's death.

    `data_parallel`: this core is one rank of a data-parallel engine (`DPAsyncLLM`): its
    devices, and in lockstep its wave group (`data_parallel_lockstep`).
    """
    if data_parallel is not None and data_parallel.visible_devices is not None:
        # NOTE: before anything initialises CUDA here or in the workers this process spawns.
        os.environ["CUDA_VISIBLE_DEVICES"] = data_parallel.visible_devices
    # NOTE: Ctrl-C reaches the whole process group; the API server owns shutdown and sends
    # ShutdownMessage, so the core must not die mid-step from the same SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s engine-core: %(message)s"
    )
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)  # bounded by admission, see the module docstring
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 1000)
    output_socket.setsockopt(zmq.SNDHWM, OUTPUT_HWM)
    output_socket.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        from fleetserve.engine.core.engine_core import EngineCore

        core = EngineCore(config)
        lockstep = None
        if data_parallel is not None and data_parallel.lockstep:
            from fleetserve.engine.distributed.data_parallel_lockstep import Lockstep

            lockstep = Lockstep.join(core, data_parallel)
    except Exception as exc:
        logger.exception("engine core failed to start")
        output_socket.send(encoder.encode(FailedMessage(error=f"{type(exc).__name__}: {exc}")))
        output_socket.close()
        ctx.term()
        raise SystemExit(1) from exc
    identity = core.connector_identity
    kv = config.kv_transfer
    ready = ReadyMessage(
        pid=os.getpid(),
        num_kv_blocks=core.scheduler.kv_cache_manager.block_pool.num_blocks,
        block_size=config.cache.block_size,
        kv_connector=(
            None
            if identity is None or kv is None
            else {
                "engine_id": identity.engine_id,
                "host": identity.host,
                "port": identity.port,
                "compatibility_hash": identity.compatibility_hash,
                "connector": kv.connector,
                "role": kv.role,
                "transfer_mode": kv.transfer_mode,
            }
        ),
    )
    output_socket.send(encoder.encode(ready))
    try:
        if lockstep is None:
            _EngineLoop(core, input_socket, output_socket).run()
        else:
            lockstep.loop(input_socket, output_socket).run()
    finally:
        if lockstep is not None:
            lockstep.close()
        core.shutdown()
        input_socket.close(linger=0)
        output_socket.close()
        ctx.term()


class RunningRequest(Protocol):
    """A request the scheduler is running, as the loop sees it: only its id."""

    @property
    def request_id(self) -> str: ...


class RunningView(Protocol):
    """The part of the scheduler the loop reads: which requests are running."""

    @property
    def running(self) -> Iterable[RunningRequest]:
        """The requests running after the last `step()`. A request appears here from the step
        that first scheduled it until it finishes or is preempted; one that finished within
        the step that scheduled it never appears (the loop sees it only in that step's
        outputs). The loop only iterates it, between steps, and never changes it."""
        ...


class LoopCore(Protocol):
    """What the process loop (`_EngineLoop`) needs from the engine core: `EngineCore`, or a
    fake in tests. The loop is its only caller, from one thread, so nothing here needs to be
    thread-safe; apart from `step()`, the methods are cheap and never block."""

    @property
    def scheduler(self) -> RunningView:
        """The scheduler, read for its running requests (first-scheduled times)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...],
        priority: int,
        cache_salt: str | None,
        arrival_time: float | None,
        kv_transfer_params: dict[str, Any] | None,
        lora_request: LoRARequest | None,
    ) -> None:
        """Queue one request; it runs in later `step()` calls.

        Raises:
            ValueError: the request is refused (its id is taken, it can never fit, its
                parameters are not for this engine); the loop reports the message to the
                API server as `rejected`. Any other exception fails only that request: the
                loop calls `abort_requests([request_id])` in case it got half-way in.
        """
        ...

    def abort_requests(self, request_ids: list[str], /) -> None:
        """Finish these requests as aborted and free what they hold; unknown or already
        finished ids are ignored. Their runner state is dropped at the next `step()`."""
        ...

    def stop_requests(self, request_ids: list[str], /) -> None:
        """Finish these requests as stopped (the front end matched a stop string); unknown or
        already finished ids are ignored, as for `abort_requests`."""
        ...

    def step(self) -> list[EngineCoreOutput]:
        """Run one step: schedule, execute, update (see `EngineCore.step`).

        Returns:
            The outputs of the requests that got tokens, finished or failed in this step; may
            be empty (e.g. a step that only drops the state of finished requests).

        An error tied to one request comes back as that request's output with `error`; an
        exception that escapes means the engine cannot go on, and it ends the loop.
        """
        ...

    def check_health(self) -> None:
        """Cheap; raises when the engine cannot go on (a worker died), which ends the loop."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work: live requests or KV transfers in flight. While true, the
        loop steps without waiting for inputs; while false, it blocks on its input socket."""
        ...

    def make_stats(self) -> SchedulerStats:
        """The stats sent with every output message. Called once per message, never more:
        it may move counters accumulated since the last call into the result."""
        ...


class _ParentGoneError(Exception):
    """The API server process died: the core has nobody to serve."""


class _EngineLoop:
    """Drain inputs, step, send outputs; one instance per core process.

    Args:
        core: the engine core it drives (`EngineCore`; see `LoopCore` for what is used).
        parent_alive: whether the API server still lives (default: this process's parent is
            the one that started it).
    """

    def __init__(
        self,
        core: LoopCore,
        input_socket: zmq.Socket[bytes],
        output_socket: zmq.Socket[bytes],
        parent_alive: Callable[[], bool] | None = None,
    ) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        if parent_alive is None:
            parent_pid = os.getppid()

            def parent_alive() -> bool:
                return os.getppid() == parent_pid

        self.parent_alive = parent_alive
        self.scheduled: set[str] = set()
        self.rejected: dict[str, str] = {}
        self.failed_adds: list[EngineCoreOutput] = []
        """Outputs (with `error`) of adds that failed otherwise than by a ValueError."""
        self.num_adds_processed = 0
        self.shutdown = False
        self.needs_step = False
        """An abort/stop happened: step once so the runner drops the finished requests' state."""
        self.stats_dirty = False

    def run(self) -> None:
        try:
            self._run()
        except _ParentGoneError:
            logger.warning("API server process is gone; engine core exits")

    def _run(self) -> None:
        while not self.shutdown:
            self._drain_inputs()
            if self.shutdown:
                return
            # NOTE: checked every iteration (a cheap syscall), also while busy: with the API
            # server gone, sends would pile up and finally block, leaving an orphan process.
            self._check_parent()
            self.core.check_health()
            if self.core.has_unfinished_requests() or self.needs_step:
                self._step()
            elif self.stats_dirty or self.rejected or self.failed_adds:
                self._send([], {})

    def _check_parent(self) -> None:
        if not self.parent_alive():
            raise _ParentGoneError

    def _drain_inputs(self) -> None:
        busy = self.core.has_unfinished_requests() or self.needs_step
        timeout_ms = 0 if busy else IDLE_POLL_MS
        while self.poller.poll(timeout_ms):
            self._receive(self.input_socket.recv())
            timeout_ms = 0
            if self.shutdown:
                return

    def _receive(self, raw: bytes) -> None:
        try:
            message = self.decoder.decode(raw)
        except msgspec.DecodeError as exc:
            # NOTE: the API server encodes every message itself, so this is a bug there; a
            # message that still names its request fails that request instead of hanging it.
            loose: Any = None
            with contextlib.suppress(msgspec.DecodeError):
                loose = msgspec.msgpack.decode(raw)
            request_id = loose.get("request_id") if isinstance(loose, dict) else None
            if isinstance(request_id, str) and loose.get("type") == "add":
                self.num_adds_processed += 1
                self._fail_add(request_id, exc)
            else:
                logger.error("dropping an undecodable message from the API server: %s", exc)
            return
        self._handle(message)

    def _handle(self, message: InputMessage) -> None:
        if isinstance(message, AddRequestMessage):
            self.num_adds_processed += 1
            try:
                self.core.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    SamplingParams.from_dict(message.params),
                    eos_token_ids=tuple(message.eos_token_ids),
                    priority=message.priority,
                    cache_salt=message.cache_salt,
                    arrival_time=message.arrival_time,
                    kv_transfer_params=message.kv_transfer_params,
                    lora_request=message.lora_request,
                )
            except ValueError as exc:
                self.rejected[message.request_id] = str(exc)
            except Exception as exc:
                logger.exception("adding request %s failed", message.request_id)
                self._fail_add(message.request_id, exc)
        elif isinstance(message, AbortMessage):
            self.core.abort_requests(message.request_ids)
            self._forget(message.request_ids)
        elif isinstance(message, StopMessage):
            self.core.stop_requests(message.request_ids)
            self._forget(message.request_ids)
        elif isinstance(message, StartWaveMessage):
            self._start_wave(message.wave)
        else:
            self.shutdown = True

    def _start_wave(self, wave: int) -> None:
        """Lockstep data parallel only (`data_parallel_lockstep`); any other core ignores it."""
        logger.warning("ignoring a data-parallel wave start (%d): this core is not lockstep", wave)

    def _fail_add(self, request_id: str, exc: Exception) -> None:
        """Fail one add that did not go in (its error reaches that request only)."""
        # NOTE: in case the add got half-way in before it raised; unknown ids are ignored.
        self.core.abort_requests([request_id])
        self.failed_adds.append(
            EngineCoreOutput(
                request_id, [], finish_reason="abort", error=f"{type(exc).__name__}: {exc}"
            )
        )

    def _forget(self, request_ids: list[str]) -> None:
        self.scheduled.difference_update(request_ids)
        self.needs_step = True
        self.stats_dirty = True

    def _step(self) -> None:
        step_start = time.monotonic()
        outputs = self.core.step()
        self.needs_step = False
        newly_scheduled: dict[str, float] = {}
        # NOTE: a request first appears in `running` after the step that scheduled it; a request
        # that finished within that same step appears only in the outputs.
        for request in self.core.scheduler.running:
            if request.request_id not in self.scheduled:
                self.scheduled.add(request.request_id)
                newly_scheduled[request.request_id] = step_start
        for output in outputs:
            if output.finished:
                if output.req_id not in self.scheduled:
                    newly_scheduled[output.req_id] = step_start
                self.scheduled.discard(output.req_id)
        self._send(outputs, newly_scheduled)

    def _send(self, outputs: list[EngineCoreOutput], scheduled_times: dict[str, float]) -> None:
        message = CoreOutputs(
            outputs=self.failed_adds + outputs,
            stats=self.core.make_stats(),
            scheduled_times=scheduled_times,
            rejected=self.rejected,
            num_adds_processed=self.num_adds_processed,
        )
        self.rejected, self.failed_adds = {}, []
        self.stats_dirty = False
        self._send_encoded(self.encoder.encode(message))

    def _send_encoded(self, data: Any) -> None:
        """Send one encoded message to the API server, however long it takes it to read."""
        while True:
            try:
                self.output_socket.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            # NOTE: the API server is not reading (busy or stalled): wait for it, which slows
            # this loop to its pace, but never past its death.
            self._check_parent()
            self.output_socket.poll(SEND_POLL_MS, zmq.POLLOUT)
