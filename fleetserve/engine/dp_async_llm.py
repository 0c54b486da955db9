"""`DPAsyncLLM`: one API server over `--data-parallel-size` N engine cores (an `EngineClient`).

Each data-parallel rank is an `AsyncLLM` with its own core process (its own scheduler, KV cache
and executor over its own tensor × pipeline ranks and devices; `fleetserve.engine.distributed.
data_parallel`). This client balances requests over the ranks and pins each to one rank for its
life; the router balances pods, this balances the ranks inside one pod.

Guarantees (besides `AsyncLLM`'s, which hold per rank):
- Balancing: a request goes to the rank with the fewest waiting + running requests (waiting
  counts the adds on their way to the core, so a burst spreads before any core reports), ties
  round-robin; all `n > 1` children of a request go to the same rank.
- Pinning: `abort` reaches the rank that runs the request.
- One failure unit: when any rank's core dies (or its output task fails), `is_healthy` turns
  False, every rank's in-flight requests fail with `EngineDeadError` and the other cores are
  stopped (a lockstep rank cannot go on without its peers; for replicas the seed's rule, a DP
  group fails as one, keeps the pod's health simple: it restarts whole).
- Admission: `max_waiting_requests` bounds the waiting sequences of the whole server (every
  rank's summed), as with one core.
- Lockstep (MoE with expert parallelism, or `force_dp_lockstep`): the waves are started here
  (`WaveTracker`): with a request while no wave runs, and when a core asks.
- Metrics: every engine series carries `engine` = the rank (`ENGINE_LABEL`), as vLLM's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from fleetserve.common.ports import free_ports
from fleetserve.engine.async_llm import AsyncLLM, slow_reader_counter
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.messages import DPWaveMessage
from fleetserve.engine.distributed.data_parallel import (
    DPCoreSpec,
    WaveTracker,
    pick_rank,
    rank_config,
    visible_devices,
)
from fleetserve.engine.engine_client import (
    DEFAULT_MAX_PENDING_OUTPUTS,
    EngineDeadError,
    check_waiting_bound,
)
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.metrics import EngineMetrics, MetricFamilies, StatsLogger
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["DPAsyncLLM", "DPStatsLogger"]

logger = logging.getLogger(__name__)


@dataclass
class DPStatsLogger(StatsLogger):
    """The server's periodic line for every rank: `DP<rank>: <that rank's line>` joined."""

    ranks: list[StatsLogger] = field(default_factory=list)

    @property
    def is_idle(self) -> bool:
        return all(r.is_idle for r in self.ranks)

    def make_line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        lines = []
        for rank, stats in enumerate(self.ranks):
            # NOTE: the server restarts the interval on this logger while idle; so do the ranks.
            stats.last_log_time = max(stats.last_log_time, self.last_log_time)
            lines.append(f"DP{rank}: {stats.make_line(now)}")
        self.last_log_time = now
        return "; ".join(lines)


class DPAsyncLLM:
    """Asyncio client of N data-parallel engine cores; create, `await start()`, `await
    shutdown()` (see the module docstring).

    Args:
        config: the engine's config, `parallel.data_parallel_size` >= 2.
        registry: where every metric goes (one series per rank, labelled `engine`).
        model_name: the served model name (the metrics' `model_name`).
        max_waiting_requests, max_pending_outputs, skip_tokenizer_init: as for `AsyncLLM`
            (the waiting bound is the whole server's).

    Raises:
        ValueError: a data_parallel_size below 2, or (on CUDA) fewer visible devices than the
            ranks need.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        registry: CollectorRegistry,
        model_name: str,
        max_waiting_requests: int,
        max_pending_outputs: int = DEFAULT_MAX_PENDING_OUTPUTS,
        skip_tokenizer_init: bool = False,
    ) -> None:
        parallel = config.parallel
        size = parallel.data_parallel_size
        if size < 2:
            raise ValueError(f"data_parallel_size must be >= 2 for DPAsyncLLM, got {size}")
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self.lockstep = parallel.needs_dp_lockstep
        families = MetricFamilies(registry, per_engine=True)
        slow_readers = slow_reader_counter(registry, per_engine=True)
        init_method = wave_address = None
        if self.lockstep:
            init_port, wave_port = free_ports(2)
            init_method = f"tcp://127.0.0.1:{init_port}"
            wave_address = f"tcp://127.0.0.1:{wave_port}"
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.ranks: list[AsyncLLM] = []
        for rank in range(size):
            devices = None
            if config.device.device == "cuda":
                devices = visible_devices(rank, parallel.world_size, inherited)
            spec = DPCoreSpec(
                rank=rank,
                size=size,
                lockstep=self.lockstep,
                wave_address=wave_address,
                visible_devices=devices,
            )
            metrics = EngineMetrics(
                registry,
                model_name,
                spec_decode=config.speculative is not None,
                families=families,
                engine=str(rank),
            )
            self.ranks.append(
                AsyncLLM(
                    rank_config(config, rank, init_method),
                    metrics=metrics,
                    max_waiting_requests=max_waiting_requests,
                    max_pending_outputs=max_pending_outputs,
                    skip_tokenizer_init=skip_tokenizer_init,
                    data_parallel=spec,
                    on_wave=functools.partial(self._on_wave, rank),
                    on_dead=functools.partial(self._on_rank_dead, rank),
                    slow_reader_aborts=slow_readers.labels(model_name, str(rank)),
                )
            )
        self.stats_logger = DPStatsLogger(ranks=[r.stats_logger for r in self.ranks])
        self.waves = WaveTracker()
        self.dummy_steps = [0] * size
        """Lockstep: dummy forwards each rank reported (at the end of each wave)."""
        self.waves_completed = [0] * size
        """Lockstep: waves each rank reported finished (equal on every rank between waves)."""
        self._owner: dict[str, int] = {}
        """Live request id → the rank that runs it."""
        self._cursor = 0
        self._dead_reason: str | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> None:
        """Start every rank's core at once (lockstep cores meet each other while starting).

        Raises:
            RuntimeError: a rank failed to start (its error, naming the rank); the caller then
                calls `shutdown()`, which stops the others.
        """
        results = await asyncio.gather(
            *(r.start(timeout_s) for r in self.ranks), return_exceptions=True
        )
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                raise RuntimeError(f"data-parallel rank {rank}: {result}") from result
        logger.info(
            "%d data-parallel engine cores ready (%s; processes %s by rank)",
            len(self.ranks),
            "lockstep" if self.lockstep else "independent replicas",
            [r.core_pid for r in self.ranks],
        )

    async def shutdown(self) -> None:
        """Stop every rank; requests still in flight fail with `EngineDeadError`."""
        self._dead_reason = self._dead_reason or "the server is shutting down"
        await asyncio.gather(*(r.shutdown() for r in self.ranks))

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.ranks[0].tokenizer

    @property
    def kv_connector(self) -> dict[str, Any] | None:
        return None  # data parallel with a KV connector is refused (arg_utils)

    @property
    def is_healthy(self) -> bool:
        return self._dead_reason is None and all(r.is_healthy for r in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.ranks)

    def loads(self) -> list[int]:
        """Per rank, the waiting + running requests the balancing compares."""
        return [r.num_waiting + r.stats_logger.last_stats.num_running_reqs for r in self.ranks]

    # -- requests -----------------------------------------------------------------------------

    def check_admission(self, num_sequences: int = 1) -> None:
        """Raise unless `num_sequences` more sequences may wait now (see `EngineClient`)."""
        if not self.is_healthy:
            raise self._dead_error()
        check_waiting_bound(self.num_waiting, num_sequences, self.max_waiting_requests)

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
        """Add a request to the least loaded rank now (see `EngineClient.generate`)."""
        if admit:
            self.check_admission(params.n)
        elif not self.is_healthy:
            raise self._dead_error()
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        rank = pick_rank(self.loads(), self._cursor)
        stream = self.ranks[rank].generate(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            admit=False,
            lora_request=lora_request,
        )
        self._cursor = rank + 1
        self._owner[request_id] = rank
        if self.lockstep:
            wave = self.waves.on_request()
            if wave is not None:
                self._start_wave(wave)
        return self._pinned(request_id, rank, stream)

    async def _pinned(
        self, request_id: str, rank: int, stream: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            async for output in stream:
                finished = output.finished
                yield output
        except Exception:
            finished = True  # the rank failed it and has forgotten it already
            raise
        finally:
            if self._owner.get(request_id) == rank:
                del self._owner[request_id]
            if not finished:
                # NOTE: the rank's own stream is not closed by leaving this one early.
                self.ranks[rank].abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort the request on the rank that runs it (no-op when unknown)."""
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self.ranks[rank].abort(request_id)

    def rank_of(self, request_id: str) -> int | None:
        """The rank a live request is pinned to (None when unknown or finished)."""
        return self._owner.get(request_id)

    # -- ranks' events ------------------------------------------------------------------------

    def _start_wave(self, wave: int) -> None:
        for r in self.ranks:
            r.start_wave(wave)

    def _on_wave(self, rank: int, message: DPWaveMessage) -> None:
        if message.kind == "complete":
            self.waves.on_complete(message.wave)
            self.dummy_steps[rank] += message.dummy_steps
            self.waves_completed[rank] = max(self.waves_completed[rank], message.wave + 1)
        else:
            wave = self.waves.on_core_request(message.wave)
            if wave is not None:
                self._start_wave(wave)

    def _on_rank_dead(self, rank: int, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = f"data-parallel rank {rank} failed: {reason}"
        logger.error("%s; stopping every rank", self._dead_reason)
        self._owner.clear()
        for other in self.ranks:
            other.kill(self._dead_reason)

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(self._dead_reason or "an engine core is not running")
