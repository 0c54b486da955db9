"""EngineCore: the step loop — schedule, execute, update — over a scheduler and an executor.

    outputs = []
    so = scheduler.schedule()                       # {req_id: num_new_tokens} under one budget
    ro = executor.execute_model(so)                 # forward + sample on the workers
    outputs = scheduler.update_from_output(so, ro)  # append tokens, check stops, free blocks

The offline `LLM` runs it in-process; the server runs it in its own process behind ZMQ. The
executor class comes from the parallel topology (`Executor.get_class(config.parallel)`); its
`initialize()` returns the KV block count the scheduler manages (the minimum over the ranks).

With pipeline parallelism the executor takes up to `max_concurrent_batches` steps without
waiting (one per stage), and `step` runs the batch queue instead (seed notes part 1 §2.14):

    if the queue has room: so = schedule(); submit it (a future)   # returns; stages overlap
    otherwise:            update_from_output(oldest so, its result)  # waits for the oldest

so that while the last stage computes batch N the first stage computes batch N + 1
(`batch_queue` explains why the scheduler's state stays exact with batches outstanding).

With `async_scheduling` (one rank) `step` schedules step N + 1 while the worker thread runs
step N, then applies step N's output (`async_scheduling.step_async`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.async_scheduling import step_async
from fleetserve.engine.core.batch_queue import BatchQueue
from fleetserve.engine.core.kv_cache_utils import get_request_block_hasher
from fleetserve.engine.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from fleetserve.engine.core.scheduler import Scheduler
from fleetserve.engine.core.step_isolation import is_unrecoverable
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.request import Request, RequestStatus
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.structured_output.factory import create_manager
from fleetserve.engine.worker.executor import Executor, ExecutorDeadError
from fleetserve.plugins.loader import load_general_plugins

logger = logging.getLogger(__name__)

_TRANSFER_POLL_S = 0.001
_GRAMMAR_POLL_S = 0.005
"""Longest wait for a grammar compile when nothing else can run (new inputs are read after)."""


class EngineCore:
    """Owns the scheduler and the executor; not thread-safe (one caller drives `step`).

    Args:
        config: the engine configuration.
        max_concurrent_batches: batches in flight at most; None: as many as the executor
            allows (`pipeline_parallel_size` with 'mp'); 1 runs every step synchronously.
            Under async scheduling it must be None (two steps in flight at most).

    Raises:
        ValueError: `max_concurrent_batches` below 1 or above what the executor allows (or set
            under async scheduling), or a data-parallel config that is not one rank's
            (`data_parallel.rank_config`).
    """

    def __init__(self, config: EngineConfig, *, max_concurrent_batches: int | None = None) -> None:
        load_general_plugins()  # before the executor builds the model (a plugin's architecture)
        parallel = config.parallel
        if parallel.data_parallel_size > 1 and parallel.data_parallel_init_method is None:
            raise ValueError(
                f"data_parallel_size={parallel.data_parallel_size} runs one engine core per "
                "rank, which `fleetserve serve` starts (DPAsyncLLM); the offline LLM and a lone "
                "EngineCore run one: use data_parallel_size 1"
            )
        self.config = config
        executor_cls = Executor.get_class(config.parallel)
        self.executor: Executor = executor_cls(config)
        allowed = self.executor.max_concurrent_batches
        num_batches = allowed if max_concurrent_batches is None else max_concurrent_batches
        self.async_queue: BatchQueue | None = None
        """Async scheduling: the steps in flight (two at most), oldest first; None: off."""
        if config.scheduler.async_scheduling:
            if max_concurrent_batches is not None or allowed != 2:
                self.executor.shutdown()
                raise ValueError(
                    "async_scheduling runs two steps in flight on the 'uni' executor's worker "
                    f"thread; got max_concurrent_batches={max_concurrent_batches} with an "
                    f"executor allowing {allowed}"
                )
            self.async_queue = BatchQueue(2)
            num_batches = 1  # NOTE: the scheduler's PP bookkeeping stays off
        elif not 1 <= num_batches <= allowed:
            self.executor.shutdown()
            raise ValueError(
                f"max_concurrent_batches must be in [1, {allowed}] for this executor, "
                f"got {max_concurrent_batches}"
            )
        self.batch_queue = BatchQueue(num_batches) if num_batches > 1 else None
        """The submitted steps, oldest first (None: every step completes before the next)."""
        num_kv_blocks = self.executor.initialize()
        connector = None
        if config.kv_transfer is not None:
            from fleetserve.engine.kv_transfer.factory import create_scheduler_role

            identity = self.executor.collective_rpc("kv_connector_identity")[0]
            connector = create_scheduler_role(config, identity)
            logger.info(
                "KV connector %s (%s, %s) as engine %s; control channel %s:%d, hash %s",
                config.kv_transfer.connector,
                config.kv_transfer.role,
                config.kv_transfer.transfer_mode,
                identity.engine_id,
                identity.host,
                identity.port,
                identity.compatibility_hash,
            )
        self.connector_identity = connector.identity if connector is not None else None
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_kv_blocks,
            connector=connector,
            load_failure_policy=(
                config.kv_transfer.load_failure_policy if config.kv_transfer else "fail"
            ),
            structured_output=create_manager(config),
            speculative_config=config.speculative,
            max_concurrent_batches=num_batches,
            max_loras=None if config.lora is None else config.lora.max_loras,
            send_sampled_tokens=config.parallel.pipeline_parallel_size > 1,
        )
        self._block_hasher = (
            get_request_block_hasher(config.cache.block_size)
            if config.cache.enable_prefix_caching
            else None
        )
        logger.info(
            "engine core ready: %d KV blocks of %d tokens (%d tokens)",
            num_kv_blocks,
            config.cache.block_size,
            (num_kv_blocks - 1) * config.cache.block_size,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...],
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a validated request (see `fleetserve.engine.validation.validate_prompt`).

        A prefill leg (`kv_transfer_params.do_remote_decode`) computes its prompt and one token,
        whatever else it asked for: its decode engine generates the rest. Its output constraint
        is dropped: that token is discarded (the decode engine samples the first token itself,
        under the constraint), so compiling the grammar here would only delay the prefill.

        Raises:
            ValueError: the request cannot be served here (its id is taken, it can never fit
                the KV cache, or its `kv_transfer_params` are malformed or not for this engine).
        """
        if (kv_transfer_params or {}).get("do_remote_decode") is True:
            if params.n != 1:
                raise ValueError("n must be 1 for a prefill leg (kv_transfer_params)")
            params = params.clone(max_tokens=1, min_tokens=0, structured_outputs=None)
        self.scheduler.add_request(
            Request(
                request_id,
                prompt_token_ids,
                params,
                eos_token_ids=eos_token_ids,
                priority=priority,
                cache_salt=cache_salt,
                arrival_time=arrival_time,
                block_hasher=self._block_hasher,
                kv_transfer_params=kv_transfer_params,
                lora_request=lora_request,
            )
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests that the front end stopped (a stop string matched)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_STOPPED)

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step: schedule, execute on the workers, update from their output.

        Returns:
            One `EngineCoreOutput` per running request that received a token this step (with
            its logprobs and, once finished, its finish reason); empty when nothing sampled.

        Side effects:
            the scheduler admits, preempts and finishes requests and allocates or frees their
            KV blocks; the workers run the forward pass and sample (when only finished or
            preempted ids are pending, they are still told, so they drop those states).

        A step whose execution raises is rolled back and its requests isolated, so a request
        that breaks a step fails alone (an output with `error`) while the others go on
        (`step_isolation`). Errors that mean the device is gone, and an engine that fails
        whatever it runs, propagate: the caller ends the engine.

        With a batch queue (pipeline parallelism) the step submits a batch or applies the
        oldest batch's output instead (`_step_with_batch_queue`); under async scheduling it
        submits the next step and then applies the previous one's output (`step_async`).
        """
        if self.async_queue is not None:
            return step_async(self, self.async_queue)
        if self.batch_queue is not None:
            return self._step_with_batch_queue(self.batch_queue)
        scheduler_output = self.scheduler.schedule()
        transfers_pending = self.scheduler.remote_kv.pending
        try:
            if scheduler_output.is_empty:
                # Still tell the runner about finished requests so it frees their state, and
                # let the connector poll its transfers and take its instructions (a request
                # waiting for its grammar was already announced: its watch must not be lost).
                runner_output = (
                    self.executor.execute_model(scheduler_output)
                    if scheduler_output.finished_req_ids
                    or scheduler_output.preempted_req_ids
                    or transfers_pending
                    or _has_connector_instructions(scheduler_output)
                    else ModelRunnerOutput.empty()
                )
            else:
                runner_output = self.executor.execute_model(scheduler_output)
        except Exception as error:
            if is_unrecoverable(error) or isinstance(error, ExecutorDeadError):
                raise
            logger.exception(
                "a step of %d request(s) failed; isolating them: %s",
                len(scheduler_output.num_scheduled_tokens),
                sorted(scheduler_output.num_scheduled_tokens),
            )
            return self.scheduler.recover_from_failed_step(scheduler_output, error)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if scheduler_output.is_empty and transfers_pending and not outputs:
            # NOTE: only transfers in flight: wait for one to advance (at most 1 ms, so that
            # new requests and leases are still served) instead of spinning.
            self.executor.collective_rpc("wait_for_kv_progress", _TRANSFER_POLL_S)
        elif scheduler_output.is_empty and not outputs:
            # NOTE: only grammars compiling (if any): wait for one instead of spinning.
            self.scheduler.structured_output.wait(_GRAMMAR_POLL_S)
        return outputs

    def _step_with_batch_queue(self, queue: BatchQueue) -> list[EngineCoreOutput]:
        """One step of the pipelined loop: submit a batch while the queue has room and there
        is work to schedule; otherwise wait for the oldest batch and update from its output.

        Returns:
            The outputs of the batch whose result was applied (none when one was submitted).

        A batch whose execution fails ends the engine (raised): the batches submitted after
        it may have read KV it should have written, so rolling back one step (the
        synchronous loop's step isolation) is not sound here. A dead worker raises
        `ExecutorDeadError` from the wait, whatever the number of batches in flight.
        """
        outputs: list[EngineCoreOutput] = []
        if not queue.full:
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty:
                queue.push(scheduler_output, self.executor.execute_model_async(scheduler_output))
                return []
            if not queue:
                # NOTE: nothing in flight and nothing to compute: the synchronous step's idle
                # path (tell the runner what finished, poll transfers, wait for grammars).
                return self._run_empty_step(scheduler_output)
            # NOTE: every schedulable request is in flight; what finished meanwhile still goes
            # to the workers, in order behind the batches already submitted.
            if _tells_runner(scheduler_output, self.scheduler.remote_kv.pending):
                queue.push(scheduler_output, self.executor.execute_model_async(scheduler_output))
            else:
                outputs = self.scheduler.update_from_output(
                    scheduler_output, ModelRunnerOutput.empty()
                )
        batch = queue.pop_oldest()
        try:
            runner_output = batch.future.result()
        except Exception:
            logger.error(
                "a pipelined step of %d request(s) failed with %d more batch(es) in flight; "
                "ending the engine",
                len(batch.scheduler_output.num_scheduled_tokens),
                len(queue),
            )
            raise
        return outputs + self.scheduler.update_from_output(batch.scheduler_output, runner_output)

    def _run_empty_step(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """A step that computes nothing, with nothing in flight: tell the workers what they
        must know, then wait briefly for transfers or grammars instead of spinning."""
        transfers_pending = self.scheduler.remote_kv.pending
        runner_output = (
            self.executor.execute_model(scheduler_output)
            if _tells_runner(scheduler_output, transfers_pending)
            else ModelRunnerOutput.empty()
        )
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if transfers_pending and not outputs:
            self.executor.collective_rpc("wait_for_kv_progress", _TRANSFER_POLL_S)
        elif not outputs:
            self.scheduler.structured_output.wait(_GRAMMAR_POLL_S)
        return outputs

    def check_health(self) -> None:
        """Raises `ExecutorDeadError` when a worker is gone (cheap; the loop calls it between
        steps, so a dead worker ends an idle engine too)."""
        self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        """Live requests, KV transfers or batches still in flight (the loop must keep
        stepping)."""
        return self.scheduler.has_pending_work() or bool(self.batch_queue) or bool(self.async_queue)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's stats, with the KV connector's (its transfer observations since the
        last call move into them: call this once per step)."""
        stats = self.scheduler.make_stats()
        queue = self.batch_queue if self.async_queue is None else self.async_queue
        if queue is not None:
            stats.num_batches_in_flight = len(queue)
            stats.max_batches_in_flight = queue.max_depth
        if self.config.kv_transfer is not None:
            # NOTE: the driver rank's counters (with TP it reports the loads for all ranks).
            kv = self.executor.collective_rpc("kv_connector_stats")[0]
            kv.blocks_recomputed = self.scheduler.remote_kv.num_recomputed_blocks
            stats.kv_transfer = kv
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release the grammar pool and the executor (batches still in flight are dropped)."""
        if self.scheduler.structured_output.manager is not None:
            self.scheduler.structured_output.manager.shutdown()
        self.executor.shutdown()


def _tells_runner(scheduler_output: SchedulerOutput, transfers_pending: bool) -> bool:
    """Whether a step that computes nothing must still reach the workers: they drop finished
    and preempted requests' states, and the connector polls its transfers and takes its
    instructions (a request waiting for its grammar was already announced: its watch must not
    be lost)."""
    return bool(
        scheduler_output.finished_req_ids
        or scheduler_output.preempted_req_ids
        or transfers_pending
        or _has_connector_instructions(scheduler_output)
    )


def _has_connector_instructions(scheduler_output: SchedulerOutput) -> bool:
    """Whether the step's connector metadata tells the workers anything (any list non-empty)."""
    meta = scheduler_output.kv_connector_metadata
    if meta is None or not dataclasses.is_dataclass(meta):
        return False
    return any(getattr(meta, f.name) for f in dataclasses.fields(meta))
