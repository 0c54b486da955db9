"""User-facing results of `LLM.generate` / `LLM.chat` (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Logprob:
    """Log-probability of one token, from the raw (unprocessed) distribution."""

    logprob: float
    rank: int | None = None
    """1 = the most likely token."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token: token id → Logprob (the sampled token plus the top-k)."""

PromptLogprobs = list[dict[int, Logprob] | None]
"""One entry per prompt token: None for the first (nothing precedes it), then token id →
Logprob for the prompt token itself plus the top-k, given the tokens before it."""


@dataclass
class CompletionOutput:
    """One of the `n` sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    """'stop', 'length' or 'abort'; None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sequence."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its outputs (complete, or the latest state while streaming)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: PromptLogprobs | None = None
    """When the request asked for `prompt_logprobs` (in a stream: the first output only)."""
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill leg's answer (on its finished output): what the decode leg must send."""
