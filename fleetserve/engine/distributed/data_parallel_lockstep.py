"""Lockstep data parallel, the core side: waves of steps that every DP rank runs together.

Under expert parallelism the EP group spans DP × TP, so each forward of each DP rank meets the
others in the MoE layers' collectives; a rank that skips a forward while another runs one hangs
both. The cores therefore step in waves (vLLM's DP coordinator, seed notes part 2 §2.4):

- A core joins wave w when the front end says so (`StartWaveMessage`, sent to every rank with a
  request while no wave runs; `WaveTracker`) and from then on runs one iteration per step:
  all-reduce "have I work?" over the cores' own gloo group (`WaveGroup`), then, if any rank has
  work, a real step, or a dummy forward when it has none (`LockstepExecutor` makes sure every
  iteration runs exactly one forward on every rank, also when the scheduler had nothing to run).
- When the all-reduce says nobody has work, every rank ends the wave on that same iteration
  (they all see the same result), reports it (`DPWaveMessage` 'complete') and waits for inputs.
- A core that gets work between waves (a request that reached it just after a wave ended, an
  abort to apply) asks the front end to start the next wave ('request') instead of stepping
  alone.

Failure: a rank that dies makes its peers' next wave all-reduce (or the forward's DP sync)
raise (gloo sees the closed connection) or time out, which ends their loops; the front end sees
any core's death and fails the whole engine (one failure unit).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zmq

from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.engine_core_proc import IDLE_POLL_MS, _EngineLoop
from fleetserve.engine.core.messages import DPWaveMessage
from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.distributed.data_parallel import DPCoreSpec
from fleetserve.engine.worker.executor import Executor, StepFuture

__all__ = ["WAVE_TIMEOUT_S", "Lockstep", "LockstepExecutor", "LockstepLoop", "WaveGroup"]

logger = logging.getLogger(__name__)

WAVE_TIMEOUT_S = 300.0
"""Bound on the cores' rendezvous and on one wave all-reduce (a peer alive but stuck)."""


class WaveGroup:
    """The DP cores' own gloo group (apart from the workers' world): one flag per iteration."""

    def __init__(self, address: str, rank: int, size: int, timeout_s: float) -> None:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
        self._group: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("dp-wave", self._store), rank, size, timeout
        )
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.size = size

    def any(self, flag: bool) -> bool:
        """Whether any rank passed True (every rank must call it, once per iteration)."""
        tensor = torch.tensor([int(flag)], dtype=torch.int64)
        self._group.allreduce([tensor], self._options).wait()
        return bool(tensor.item())

    def close(self) -> None:
        self._group = None
        self._store = None  # type: ignore[assignment]


class LockstepExecutor(Executor):
    """Wraps a core's executor so that each lockstep iteration runs exactly one forward.

    `EngineCore.step` skips the executor when the scheduler has nothing to run; `ensure_forward`
    then runs the dummy batch. (The worker runs one forward per `execute_model` call, a dummy
    one when the step computes no token.)
    """

    def __init__(self, inner: Executor) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.forwarded = False
        """Whether the current iteration has run its forward."""

    def initialize(self) -> int:
        return self.inner.initialize()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.forwarded = True
        return self.inner.execute_model(scheduler_output)

    @property
    def max_concurrent_batches(self) -> int:
        return self.inner.max_concurrent_batches

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        self.forwarded = True
        return self.inner.execute_model_async(scheduler_output)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.inner.collective_rpc(method, *args, **kwargs)

    def check_health(self) -> None:
        self.inner.check_health()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def ensure_forward(self) -> None:
        """End an iteration: run the dummy forward unless a step ran one."""
        if not self.forwarded:
            self.inner.collective_rpc("execute_dummy_batch")
        self.forwarded = False


class LockstepLoop(_EngineLoop):
    """The core's loop in waves (see the module docstring)."""

    def __init__(
        self,
        core: EngineCore,
        executor: LockstepExecutor,
        group: WaveGroup,
        input_socket: zmq.Socket[bytes],
        output_socket: zmq.Socket[bytes],
    ) -> None:
        super().__init__(core, input_socket, output_socket)
        self.executor = executor
        self.group = group
        self.completed = 0
        """Waves this core has finished (the same count on every rank between waves)."""
        self.start_requested = -1
        """The highest wave the front end said to start."""
        self.asked = -1
        """The highest wave this core asked the front end for."""
        self.in_wave = False
        self.num_dummy_steps = 0
        """Dummy forwards in the current wave (reported with its end)."""

    def _start_wave(self, wave: int) -> None:
        self.start_requested = max(self.start_requested, wave)

    def _drain_inputs(self) -> None:
        # NOTE: within a wave, never block: the peers wait in the next all-reduce.
        timeout_ms = 0 if self.in_wave else IDLE_POLL_MS
        while self.poller.poll(timeout_ms):
            self._receive(self.input_socket.recv())
            timeout_ms = 0
            if self.shutdown:
                return

    def _run(self) -> None:
        while not self.shutdown:
            self._drain_inputs()
            if self.shutdown:
                return
            self._check_parent()
            self.core.check_health()
            busy = self.core.has_unfinished_requests() or self.needs_step
            if not self.in_wave:
                if self.start_requested >= self.completed:
                    self.in_wave = True
                else:
                    if busy and self.asked < self.completed:
                        self.asked = self.completed
                        self._send_wave("request", self.completed)
                    if self.stats_dirty or self.rejected or self.failed_adds:
                        self._send([], {})
                    continue
            if not self.group.any(busy):
                self.in_wave = False
                self.completed += 1
                self._send_wave("complete", self.completed - 1, self.num_dummy_steps)
                self.num_dummy_steps = 0
                if self.stats_dirty or self.rejected or self.failed_adds:
                    self._send([], {})
                continue
            if busy:
                self._step()
            else:
                self.num_dummy_steps += 1
            self.executor.ensure_forward()

    def _send_wave(self, kind: str, wave: int, dummy_steps: int = 0) -> None:
        self._send_encoded(
            self.encoder.encode(DPWaveMessage(kind=kind, wave=wave, dummy_steps=dummy_steps))
        )


class Lockstep:
    """A lockstep core's wiring: its executor wrapped, its wave group joined."""

    def __init__(self, core: EngineCore, executor: LockstepExecutor, group: WaveGroup) -> None:
        self.core = core
        self.executor = executor
        self.group = group

    @classmethod
    def join(cls, core: EngineCore, spec: DPCoreSpec) -> Lockstep:
        """Wrap `core`'s executor and join the other cores' wave group (blocks until every
        rank has joined, at most `WAVE_TIMEOUT_S`); shuts `core` down when that fails."""
        assert spec.wave_address is not None, "a lockstep core needs its wave group's address"
        try:
            group = WaveGroup(spec.wave_address, spec.rank, spec.size, WAVE_TIMEOUT_S)
        except Exception:
            core.shutdown()
            raise
        executor = LockstepExecutor(core.executor)
        core.executor = executor
        logger.info("data-parallel rank %d of %d steps in lockstep", spec.rank, spec.size)
        return cls(core, executor, group)

    def loop(
        self, input_socket: zmq.Socket[bytes], output_socket: zmq.Socket[bytes]
    ) -> LockstepLoop:
        return LockstepLoop(self.core, self.executor, self.group, input_socket, output_socket)

    def close(self) -> None:
        self.group.close()
