"""The step contract's delta encoding: new requests go to the runner in full once, running ones
as deltas (the blocks added since they were last sent, and their new tokens only where a runner
does not sample them itself).

Sampled tokens do not make a round trip: a runner that samples appends each token to its own
request state and input row when it samples it (`ModelRunner._append_tokens`), so a one-stage
engine sends running requests no tokens. Every way a request's tokens can differ from what its
runner sampled goes through a full resend: a preempted or failed-step request comes back as a
new request, and a request whose tokens the scheduler truncates (a stop token inside accepted
drafts, a grammar error) finishes. Only the stages of a pipeline before the last sample nothing;
with several stages the tokens go to every runner (the last stage's just confirm its own).
"""

from __future__ import annotations

from collections.abc import Callable

from fleetserve.engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from fleetserve.engine.request import Request

__all__ = ["StepDeltas"]


class StepDeltas:
    """Remembers, per request, how many of its tokens the runner has been sent.

    `send_tokens`: whether running requests' new tokens go to the runners (a pipeline of several
    stages); without it `CachedRequestData.new_token_ids` stays empty.
    """

    def __init__(self, *, send_tokens: bool) -> None:
        self.send_tokens = send_tokens
        self._num_tokens_sent: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        """The request left the runner (finished or preempted): it is sent in full next time."""
        self._num_tokens_sent.pop(request_id, None)

    def build(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        new_block_ids: dict[str, list[int]],
        num_scheduled: dict[str, int],
        *,
        finished_req_ids: set[str],
        preempted_req_ids: set[str],
        block_ids_of: Callable[[str], list[int]],
        new_block_ids_to_zero: list[int],
    ) -> SchedulerOutput:
        """The `SchedulerOutput` of one step (the connector's metadata is added by the caller)."""
        new_reqs = []
        for request in scheduled_new:
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=block_ids_of(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    eos_token_ids=request.eos_token_ids,
                    lora_request=request.lora_request,
                )
            )
            if self.send_tokens:
                self._num_tokens_sent[request.request_id] = request.num_tokens
        cached = CachedRequestData(
            req_ids=[request.request_id for request in scheduled_running],
            new_block_ids=[new_block_ids[request.request_id] for request in scheduled_running],
            num_computed_tokens=[request.num_computed_tokens for request in scheduled_running],
        )
        if self.send_tokens:
            for request in scheduled_running:
                num_sent = self._num_tokens_sent.get(request.request_id, request.num_tokens)
                cached.new_token_ids.append(request.all_token_ids[num_sent:])
                self._num_tokens_sent[request.request_id] = request.num_tokens
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids=preempted_req_ids,
            new_block_ids_to_zero=new_block_ids_to_zero,
        )
