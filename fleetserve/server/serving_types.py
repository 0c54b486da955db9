"""The request as the generation pipeline carries it, and the shape an endpoint gives it.

`OpenAIServing.prepare` (serving.py) builds a `PreparedRequest` (its prompts as `PromptInput`s);
a non-streaming response accumulates a `ChoiceState` per choice; an endpoint shapes its
responses through a `ResponseFormat` (`serving_completion.py`, `serving_chat.py`), whose
bodies and chunks share `envelope`, `choice_end` and `has_output`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetserve.engine.request_output import CompletionOutput, Logprob, PromptLogprobs
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.openai.protocol import SamplingRequest, UsageInfo

__all__ = [
    "REQUEST_ID_HEADER",
    "ChoiceState",
    "PreparedRequest",
    "PromptInput",
    "ResponseFormat",
    "choice_end",
    "envelope",
    "has_output",
]

REQUEST_ID_HEADER = "X-Request-Id"


@dataclass
class ChoiceState:
    """One choice accumulated over the deltas of a non-streaming request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a request and the engine request that serves it."""

    request_id: str
    token_ids: list[int]
    text: str | None
    """The prompt as the client sent it, when it was text."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the engine."""

    request_id: str
    """The response's id (`{prefix}-{X-Request-Id}` when the client named the request)."""
    body: SamplingRequest
    prompts: list[PromptInput]
    params: SamplingParams
    client_request_id: str | None = None
    return_token_ids: bool = False
    """Responses carry token ids (asked for, or the only output without a tokenizer)."""
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    """Prompt index → its prompt logprobs, filled as outputs arrive (echo with logprobs)."""
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    """The engine's answer to a P/D leg (a producer's), filled when the request finishes."""

    @property
    def headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.client_request_id} if self.client_request_id else {}

    @property
    def log_name(self) -> str:
        """How logs name it: the first engine id, and the client's id when it sent one."""
        name = self.prompts[0].request_id
        return (
            f"{name} (X-Request-Id {self.client_request_id!r})" if self.client_request_id else name
        )

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        """The response's numbering: prompt p's sequence j is choice `p * n + j`."""
        return prompt_index * self.params.n + completion_index

    def prompt_of(self, choice_index: int) -> PromptInput:
        return self.prompts[choice_index // self.params.n]


class ResponseFormat(Protocol):
    """How one endpoint shapes its responses (one instance per request: it may keep state
    across the chunks of a stream)."""

    def full(self, prepared: PreparedRequest, choices: list[ChoiceState], usage: UsageInfo) -> str:
        """The JSON body of a non-streaming response."""
        ...

    def first_chunks(self, prepared: PreparedRequest) -> list[str]:
        """Chunks sent before any output (chat: each choice's role)."""
        ...

    def chunk(
        self,
        prepared: PreparedRequest,
        choice_index: int,
        delta: CompletionOutput,
        usage: UsageInfo | None,
    ) -> str | None:
        """The chunk of one choice's delta, or None when it carries nothing."""
        ...

    def usage_chunk(self, prepared: PreparedRequest, usage: UsageInfo) -> str:
        """The final usage-only chunk (`stream_options.include_usage`)."""
        ...


def envelope(
    prepared: PreparedRequest, model_name: str, usage: UsageInfo | None, *, final: bool
) -> dict[str, Any]:
    """The fields a response body or stream chunk of either endpoint opens with. A P/D leg's
    `kv_transfer_params` go only with the `final` ones: the full body, a choice's last chunk."""
    return {
        "id": prepared.request_id,
        "model": model_name,
        "usage": usage,
        "kv_transfer_params": (prepared.kv_transfer_params or None) if final else None,
    }


def choice_end(
    prepared: PreparedRequest,
    choice_index: int,
    output: ChoiceState | CompletionOutput,
    *,
    with_prompt_ids: bool,
) -> dict[str, Any]:
    """The fields every choice ends with (`_ChoiceEnd`); the token id lists only with
    `return_token_ids`, the prompt's only `with_prompt_ids`."""
    want_ids = prepared.return_token_ids
    return {
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
        "prompt_token_ids": (
            prepared.prompt_of(choice_index).token_ids if want_ids and with_prompt_ids else None
        ),
        "token_ids": output.token_ids if want_ids else None,
    }


def has_output(delta: CompletionOutput) -> bool:
    """Whether a stream delta is worth a chunk: text, token ids or the choice's finish."""
    return bool(delta.text or delta.finish_reason or delta.token_ids)
