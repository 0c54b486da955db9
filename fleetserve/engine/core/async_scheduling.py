"""Async scheduling: the engine core schedules step N + 1 while the worker runs step N.

With `async_scheduling` the executor runs steps on a worker thread (`UniProcExecutor`), at
most two in flight, and `EngineCore.step` does, per call (`AsyncStepper.step`):

    so = schedule()                    # step N + 1, while step N runs on the worker thread
    submit(so)                         # queued behind step N on the worker thread
    update_from_output(N, wait(N))     # step N's tokens, stop checks, frees

so the engine core's Python work (scheduling, applying outputs, detokenizing in the offline
`LLM`) overlaps the forward pass. Only one step is ever in flight while the scheduler runs.

How a running decode is scheduled before its step-N token is known (`AsyncRequestState`):

- Output placeholders: a step that samples a request (its known tokens all computed by it)
  adds one placeholder; the step's output removes it. The scheduler counts
  `num_tokens + num_output_placeholders` as the request's length, so the decode of step N + 1
  computes position T (the token step N samples) while the token itself is unknown here.
- The input token: the runner appends each token it samples to its own request state (and to
  the persistent batch's token row), and the worker thread runs steps in order, so when step
  N + 1 prepares its inputs the token of step N is in the row: nothing goes back through the
  scheduler (`step_deltas`: a one-stage engine sends running requests no tokens).
- Limits: a request whose placeholders already reach `max_tokens` or the longest sequence is
  not scheduled again: its in-flight token is its last (or it stops earlier).
- A request that finishes at step N (EOS, stop token, length, abort) while it is also in step
  N + 1: its blocks are freed when step N's output is applied; step N + 1 still computes it on
  the worker (the blocks are reused only by steps submitted later, which run after it and
  zero new blocks first), and step N + 1's token for it is dropped: the request is gone, or
  (aborted and resubmitted under the same id) another object (`scheduled_objects`).
- Preemption while in flight: the victim's step-N token arrives after it was preempted; it is
  still its token (seed notes part 1 §2.11: stale tokens are delivered, never lost), so it is
  appended while the request waits, and a stop it meets finishes it there. Resumed by
  recompute, the request then continues exactly where a synchronous engine would.

Steps that need the previous step's result first run synchronously: the core waits for the
step in flight before scheduling (`needs_output_first`) while a constrained request
(structured output: its grammar bitmask needs its accepted tokens) is in flight, and while
step isolation runs suspects alone after a failed step. Speculative decoding (drafts come from
the previous step's output), KV connectors (per-step transfer metadata and polling), several
ranks and lockstep data parallel are refused with the flag
(`fleetserve.engine.arg_utils.async_scheduling_blockers`: the API process parses the flag and
must not import the engine core); an optimization level's default just leaves async
scheduling off there.

A step that fails with another in flight: both are rolled back (the later one read state the
failed one should have produced), the later one's requests are preempted and the failed
one's isolated as in the synchronous engine (`Scheduler.recover_from_failed_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING

from fleetserve.engine.core.block_pool import KVCacheBlock
from fleetserve.engine.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.core.step_isolation import is_unrecoverable
from fleetserve.engine.request import Request

if TYPE_CHECKING:
    from fleetserve.engine.core.batch_queue import BatchQueue
    from fleetserve.engine.core.engine_core import EngineCore
    from fleetserve.engine.core.scheduler import Scheduler

__all__ = ["AsyncRequestState", "step_async"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _ScheduledStep:
    """What the scheduler remembers of one step in flight."""

    requests: dict[str, Request]
    """The request objects the step carries, by id (its output applies to these only)."""
    cached_blocks: list[KVCacheBlock]
    """Blocks the step's schedule indexed in the prefix cache (unindexed if the step fails)."""


class AsyncRequestState:
    """The scheduler's bookkeeping for steps scheduled before the previous step's output.

    Args:
        scheduler: the scheduler it serves (its requests, KV manager and limits are read).
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._steps: dict[int, tuple[SchedulerOutput, _ScheduledStep]] = {}
        """id(scheduler_output) → (the output, kept alive so that the id stays unique, and the
        step's bookkeeping), for every step scheduled and not yet updated."""

    def __len__(self) -> int:
        """Steps scheduled whose output has not been applied."""
        return len(self._steps)

    def at_limit(self, request: Request) -> bool:
        """Whether the tokens in flight already reach the request's end (max_tokens or the
        longest sequence): scheduling it again could only compute a discarded token."""
        pending = request.num_output_placeholders
        if pending == 0:
            return False
        if request.num_tokens + pending >= self.scheduler.max_seq_len:
            return True
        return request.max_tokens is not None and (
            request.num_output_tokens + pending >= request.max_tokens
        )

    def after_schedule(self, output: SchedulerOutput) -> None:
        """Record a step just scheduled (its requests' `num_computed_tokens` already advanced):
        a request whose known tokens and placeholders the step completes samples a token in
        it, so it gets one more placeholder."""
        requests = self.scheduler.requests
        carried: dict[str, Request] = {}
        for req_id in output.num_scheduled_tokens:
            request = requests[req_id]
            carried[req_id] = request
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        cached = self.scheduler.kv_cache_manager.take_newly_cached()
        self._steps[id(output)] = (output, _ScheduledStep(carried, cached))

    def complete(self, output: SchedulerOutput) -> dict[str, Request]:
        """The step's output arrived (or it computed nothing): returns the request objects it
        carried (empty for a step never recorded, e.g. an empty one)."""
        entry = self._steps.pop(id(output), None)
        return {} if entry is None else entry[1].requests

    def resolve(self, request: Request) -> None:
        """One of the request's tokens arrived: its placeholder is resolved (a preempted
        request has none left: its in-flight tokens were counted off at preemption)."""
        if request.num_output_placeholders > 0:
            request.num_output_placeholders -= 1

    def live(self, output: SchedulerOutput) -> dict[str, int]:
        """The step's scheduled tokens of the requests that are still the ones it carried
        (a request finished or resubmitted since then is left out)."""
        entry = self._steps.get(id(output))
        carried = {} if entry is None else entry[1].requests
        requests = self.scheduler.requests
        return {
            req_id: num
            for req_id, num in output.num_scheduled_tokens.items()
            if carried.get(req_id) is requests.get(req_id) is not None
        }

    def discard(self, output: SchedulerOutput) -> None:
        """Forget a step that failed or is rolled back; the blocks its schedule indexed are
        unindexed (their KV was never, or only partly, written)."""
        entry = self._steps.pop(id(output), None)
        if entry is not None:
            self.scheduler.kv_cache_manager.drop_cached(entry[1].cached_blocks)


def step_async(core: EngineCore, queue: BatchQueue) -> list[EngineCoreOutput]:
    """One call of the asynchronous loop (module doc): schedule and submit the next step,
    then wait for the oldest and apply its output.

    Returns:
        The outputs of the step whose result was applied (none on the first call, which only
        submits; a step that computes nothing is applied at once, as in the synchronous loop).

    Raises:
        Exception: an unrecoverable error or a dead executor (the caller ends the engine); any
            other step error is recovered from as in the synchronous loop (module doc).
    """
    from fleetserve.engine.core.engine_core import _GRAMMAR_POLL_S, _tells_runner

    scheduler = core.scheduler
    outputs: list[EngineCoreOutput] = []
    if queue and scheduler.needs_output_first():
        # NOTE: a sync step: the schedule below needs the in-flight step's result first.
        outputs += _apply_oldest(core, queue)
    scheduler_output = scheduler.schedule()
    idle = scheduler_output.is_empty and not queue
    if not scheduler_output.is_empty or _tells_runner(
        scheduler_output, scheduler.remote_kv.pending
    ):
        queue.push(scheduler_output, core.executor.execute_model_async(scheduler_output))
        if not queue.full and not outputs and not idle:
            # NOTE: nothing else in flight: return, so that the next call schedules the next
            # step while this one runs.
            return outputs
    else:
        # NOTE: nothing to compute or tell (every request in flight or at its limit).
        outputs += scheduler.update_from_output(scheduler_output, ModelRunnerOutput.empty())
    if queue:
        outputs += _apply_oldest(core, queue)
    if idle and not outputs:
        # NOTE: only grammars compiling (if any): wait for one instead of spinning.
        scheduler.structured_output.wait(_GRAMMAR_POLL_S)
    return outputs


def _apply_oldest(core: EngineCore, queue: BatchQueue) -> list[EngineCoreOutput]:
    """Wait for the oldest step in flight and apply its output; a step that raised is rolled
    back with every later step and its requests isolated (module doc)."""
    from fleetserve.engine.worker.executor import ExecutorDeadError

    batch = queue.pop_oldest()
    try:
        runner_output = batch.future.result()
    except Exception as error:
        if is_unrecoverable(error) or isinstance(error, ExecutorDeadError):
            raise
        later = [queue.pop_oldest() for _ in range(len(queue))]
        for step in later:
            # NOTE: a later step depends on the failed one: whatever it did is undone below.
            with contextlib.suppress(Exception):
                step.future.result()
        logger.exception(
            "an async step of %d request(s) failed with %d more in flight; isolating them",
            len(batch.scheduler_output.num_scheduled_tokens),
            len(later),
        )
        return core.scheduler.recover_from_failed_async_step(
            batch.scheduler_output, [step.scheduler_output for step in later], error
        )
    return core.scheduler.update_from_output(batch.scheduler_output, runner_output)
