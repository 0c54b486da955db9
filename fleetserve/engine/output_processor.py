"""Front-end side of a request: detokenize, check stop strings, build `RequestOutput`s.

The engine core only sees token ids; this processor owns each request's incremental detokenizer
and logprobs (shaped by `logprobs.py`), and all of the `n > 1` bookkeeping: it fans a request
out into n child requests (ids `"{index}_{request_id}"`), maps each child back to its parent,
tracks which children the core has scheduled yet (the waiting sequences admission counts) and
gathers their outputs into one `RequestOutput` per parent. Callers (`LLM`, `AsyncLLM`) key
their own state by the parent id only. A stop string is found here, not in the engine core, so
`process_outputs` returns the child ids the caller must finish in the engine (FINISHED_STOPPED).

Failures stay with their request: a core output carrying `error` (the engine failed that
sequence), or an exception while folding one output in, fails that output's parent, which is
forgotten and reported in `ProcessedOutputs.failed` with the error text (its other children in
`reqs_to_abort`); the other requests of the step are unaffected. Without a tokenizer
(`skip_tokenizer_init`) outputs carry token ids only and empty text.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetserve.engine.core.outputs import EngineCoreOutput, LogprobsLists
from fleetserve.engine.detokenizer import IncrementalDetokenizer
from fleetserve.engine.logprobs import (
    logprob_entries,
    prompt_logprobs_entries,
    sampled_logprob_sum,
)
from fleetserve.engine.request_output import (
    CompletionOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from fleetserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class OutputKind(enum.Enum):
    FINAL = "final"
    """One RequestOutput when every sequence has finished (offline `generate`)."""
    DELTA = "delta"
    """Each output carries only the new text/tokens since the previous one (streaming)."""
    CUMULATIVE = "cumulative"
    """Each output carries everything so far."""


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Per-sequence params of an n > 1 request: n=1, and distinct seeds derived from the seed.

    Only the first sequence computes prompt logprobs (they are the prompt's, shared by all)."""
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return params.clone(n=1, seed=seed, prompt_logprobs=prompt_logprobs)


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer | None
    """None without a tokenizer (token ids only)."""
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    scheduled: bool = False
    """The core reported that it scheduled this sequence (it no longer waits)."""


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    sequences: dict[str, _Sequence]
    kv_transfer_params: dict[str, Any] | None = None
    """The connector's answer for a finished prefill leg."""
    num_cached_tokens: int = 0
    want_prompt_logprobs: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    """Set from the first sequence's first output (only that sequence computes them)."""
    prompt_logprobs_sent: bool = False
    scheduled: bool = False
    """Some sequence of the request has been scheduled (its queue time is known)."""

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())

    @property
    def num_unscheduled(self) -> int:
        return sum(not s.scheduled for s in self.sequences.values())


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_finish: list[str]
    """Child ids that matched a stop string: finish them in the engine as FINISHED_STOPPED."""
    failed: dict[str, str] = field(default_factory=dict)
    """Parent id → why it failed; already forgotten here, answer it with an error."""
    reqs_to_abort: list[str] = field(default_factory=list)
    """Child ids of failed parents still live in the engine: abort them there."""


class OutputProcessor:
    """Tracks live requests (parents and their children) and turns engine-core outputs into
    RequestOutputs; the one owner of the child ↔ parent map."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self._tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}
        self._num_unscheduled = 0

    def __len__(self) -> int:
        return len(self._parents)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    @property
    def num_unscheduled(self) -> int:
        """Sequences (children) of live requests that the core has not scheduled yet."""
        return self._num_unscheduled

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kind: OutputKind = OutputKind.FINAL,
    ) -> dict[str, SamplingParams]:
        """Register a request; returns {child id: child params} to add to the engine core."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = (
            {request_id: params}
            if params.n == 1
            else {child_request_id(request_id, i): child_params(params, i) for i in range(params.n)}
        )
        sequences = {
            child_id: _Sequence(
                index=i,
                detokenizer=(
                    None
                    if self._tokenizer is None
                    else IncrementalDetokenizer(self._tokenizer, prompt_token_ids, child)
                ),
                want_logprobs=child.logprobs is not None,
            )
            for i, (child_id, child) in enumerate(children.items())
        }
        self._parents[request_id] = _Parent(
            request_id,
            prompt,
            prompt_token_ids,
            kind,
            sequences,
            want_prompt_logprobs=params.prompt_logprobs is not None,
        )
        for child_id in children:
            self._child_to_parent[child_id] = request_id
        self._num_unscheduled += len(children)
        return children

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.sequences) if parent else []

    def parent_id_of(self, child_id: str) -> str | None:
        """The parent request of a core request id (None once the parent is gone)."""
        return self._child_to_parent.get(child_id)

    def record_scheduled(self, child_id: str) -> str | None:
        """Note that the core scheduled `child_id` (it stops counting as waiting).

        Returns:
            The parent's id the first time any of its sequences is scheduled (the moment its
            queue time ends); None after that, or when the child is unknown.
        """
        parent_id = self._child_to_parent.get(child_id)
        if parent_id is None:
            return None
        parent = self._parents[parent_id]
        seq = parent.sequences[child_id]
        if not seq.scheduled:
            seq.scheduled = True
            self._num_unscheduled -= 1
        if parent.scheduled:
            return None
        parent.scheduled = True
        return parent_id

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request (by parent id); returns the child ids to abort in the engine."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for child_id in parent.sequences:
            self._child_to_parent.pop(child_id, None)
        self._num_unscheduled -= parent.num_unscheduled
        return list(parent.sequences)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Fold one step's core outputs into the live requests.

        Returns:
            The RequestOutputs to deliver (per parent: each step in DELTA and CUMULATIVE
            modes, once when finished in FINAL mode) and the child ids whose stop string
            matched here, which the caller must finish in the core. Finished parents are
            forgotten; outputs of unknown (aborted) children are dropped.
        """
        touched: dict[str, _Parent] = {}
        to_finish: list[str] = []
        failed: dict[str, str] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent_id = self._child_to_parent.get(out.req_id)
            if parent_id is None:
                continue  # aborted by the caller while the step ran
            parent = self._parents[parent_id]
            seq = parent.sequences[out.req_id]
            if seq.finish_reason is not None:
                continue
            if out.error is not None:
                # NOTE: the core finished this sequence already; only its siblings still run.
                failed[parent_id] = out.error
                touched.pop(parent_id, None)
                to_abort += [c for c in self.abort_request(parent_id) if c != out.req_id]
                continue
            try:
                if self._fold(parent, seq, out):
                    to_finish.append(out.req_id)
            except Exception as exc:
                logger.exception("processing an output of request %s failed", parent_id)
                failed[parent_id] = f"{type(exc).__name__}: {exc}"
                touched.pop(parent_id, None)
                to_abort += self.abort_request(parent_id)
                continue
            touched[parent_id] = parent
        results = []
        for parent in touched.values():
            if parent.kind is OutputKind.FINAL and not parent.finished:
                continue
            try:
                results.append(self._make_output(parent))
            except Exception as exc:
                logger.exception("building the output of request %s failed", parent.request_id)
                failed[parent.request_id] = f"{type(exc).__name__}: {exc}"
                to_abort += self.abort_request(parent.request_id)
                continue
            if parent.finished:
                self.abort_request(parent.request_id)
        aborted = set(to_abort)
        to_finish = [c for c in to_finish if c not in aborted]
        return ProcessedOutputs(results, to_finish, failed, to_abort)

    def _fold(self, parent: _Parent, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Fold one core output into its parent; True when a stop string ended `seq`."""
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            parent.kv_transfer_params = out.kv_transfer_params
        if parent.want_prompt_logprobs and parent.prompt_logprobs is None and seq.index == 0:
            assert self._tokenizer is not None, "logprobs need a tokenizer (refused earlier)"
            parent.prompt_logprobs = prompt_logprobs_entries(out.prompt_logprobs, self._tokenizer)
        return self._apply(seq, out)

    def _apply(self, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Fold one engine output into the sequence; True when a stop string ended it."""
        seq.token_ids.extend(out.new_token_ids)
        if seq.want_logprobs and out.new_logprobs is not None:
            self._add_logprobs(seq, out.new_logprobs)
        if seq.detokenizer is None:
            stop_str = None  # no stop strings without a tokenizer (refused earlier)
        else:
            stop_str = seq.detokenizer.update(out.new_token_ids, out.finish_reason == "stop")
        if stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
            return out.finish_reason is None
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _add_logprobs(self, seq: _Sequence, rows: LogprobsLists) -> None:
        assert self._tokenizer is not None, "logprobs need a tokenizer (refused earlier)"
        seq.logprobs.extend(logprob_entries(rows, self._tokenizer))
        seq.cumulative_logprob += sampled_logprob_sum(rows)

    def _make_output(self, parent: _Parent) -> RequestOutput:
        delta = parent.kind is OutputKind.DELTA
        completions = []
        for seq in sorted(parent.sequences.values(), key=lambda s: s.index):
            finished = seq.finish_reason is not None
            text = (
                ""
                if seq.detokenizer is None
                else seq.detokenizer.get_next_output_text(finished, delta)
            )
            token_ids = seq.token_ids[seq.sent_tokens :] if delta else list(seq.token_ids)
            logprobs = seq.logprobs[seq.sent_logprobs :] if delta else list(seq.logprobs)
            if delta:
                seq.sent_tokens, seq.sent_logprobs = len(seq.token_ids), len(seq.logprobs)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=token_ids,
                    logprobs=logprobs if seq.want_logprobs else None,
                    cumulative_logprob=seq.cumulative_logprob if seq.want_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt_logprobs = parent.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = None if parent.prompt_logprobs_sent else prompt_logprobs
            parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=parent.kv_transfer_params if parent.finished else None,
        )
