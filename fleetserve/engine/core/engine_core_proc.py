"""The EngineCore in its own process, behind two ZMQ sockets carrying msgpack (msgspec).

Lifecycle (ARCHITECTURE.md §1):

1. The API server binds a PUSH socket (requests in) and a PULL socket (outputs out) and spawns
   `run_engine_core` with the "spawn" start method (torch and fork do not mix).
2. The core process connects, builds the `EngineCore` (loads the model) and sends `ReadyMessage`
   (or `FailedMessage` with the error text, then exits). The messages are in `messages.py`.
3. Busy loop: drain the input socket (adds, aborts, stops; non-blocking while there is work, a
   blocking poll when idle), run one `step()`, and send the step's outputs together with the
   scheduler's stats and the first-scheduled times of requests that started running.
4. `ShutdownMessage`, the parent's death or a crash in `step()` ends the loop; the API server
   notices the dead process (its /health fails and in-flight requests end with an error).

Tokenization, detokenization and HTTP never run here, so they never stall the step loop.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

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
    StopMessage,
)
from fleetserve.engine.core.outputs import EngineCoreOutput
from fleetserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500
"""Blocking poll when idle; also how often an idle core checks that its parent still lives."""


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Process entry point: serve `config`'s engine until shutdown or the parent's death."""
    # NOTE: Ctrl-C reaches the whole process group; the API server owns shutdown and sends
    # ShutdownMessage, so the core must not die mid-step from the same SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s engine-core: %(message)s"
    )
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 1000)
    output_socket.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        from fleetserve.engine.core.engine_core import EngineCore

        core = EngineCore(config)
    except Exception as exc:
        logger.exception("engine core failed to start")
        output_socket.send(encoder.encode(FailedMessage(error=f"{type(exc).__name__}: {exc}")))
        output_socket.close()
        ctx.term()
        raise SystemExit(1) from exc
    output_socket.send(encoder.encode(ReadyMessage(pid=os.getpid())))
    try:
        _EngineLoop(core, input_socket, output_socket).run()
    finally:
        core.shutdown()
        input_socket.close(linger=0)
        output_socket.close()
        ctx.term()


class _EngineLoop:
    """Drain inputs, step, send outputs; one instance per core process."""

    def __init__(
        self, core: Any, input_socket: zmq.Socket[bytes], output_socket: zmq.Socket[bytes]
    ) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.parent_pid = os.getppid()
        self.scheduled: set[str] = set()
        self.rejected: dict[str, str] = {}
        self.shutdown = False
        self.needs_step = False
        """An abort/stop happened: step once so the runner drops the finished requests' state."""
        self.stats_dirty = False

    def run(self) -> None:
        while not self.shutdown:
            self._drain_inputs()
            if self.shutdown:
                return
            # NOTE: checked every iteration (a cheap syscall), also while busy: with the API
            # server gone, sends would pile up and finally block, leaving an orphan process.
            if os.getppid() != self.parent_pid:
                logger.warning("API server process is gone; engine core exits")
                return
            if self.core.has_unfinished_requests() or self.needs_step:
                self._step()
            elif self.stats_dirty or self.rejected:
                self._send([], {})

    def _drain_inputs(self) -> None:
        busy = self.core.has_unfinished_requests() or self.needs_step
        timeout_ms = 0 if busy else IDLE_POLL_MS
        while self.poller.poll(timeout_ms):
            self._handle(self.decoder.decode(self.input_socket.recv()))
            timeout_ms = 0
            if self.shutdown:
                return

    def _handle(self, message: InputMessage) -> None:
        if isinstance(message, AddRequestMessage):
            try:
                self.core.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    SamplingParams.from_dict(message.params),
                    eos_token_ids=tuple(message.eos_token_ids),
                    priority=message.priority,
                    cache_salt=message.cache_salt,
                    arrival_time=message.arrival_time,
                )
            except ValueError as exc:
                self.rejected[message.request_id] = str(exc)
        elif isinstance(message, AbortMessage):
            self.core.abort_requests(message.request_ids)
            self._forget(message.request_ids)
        elif isinstance(message, StopMessage):
            self.core.stop_requests(message.request_ids)
            self._forget(message.request_ids)
        else:
            self.shutdown = True

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
            outputs=outputs,
            stats=self.core.make_stats(),
            scheduled_times=scheduled_times,
            rejected=self.rejected,
        )
        self.rejected = {}
        self.stats_dirty = False
        self.output_socket.send(self.encoder.encode(message))
