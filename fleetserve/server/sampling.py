"""OpenAI request bodies → the engine's `SamplingParams` (the one place the two meet).

OpenAI's defaults and names map onto vLLM's: an absent `temperature`/`top_p` is 1, `top_k`
and `min_p` absent are off, chat's `max_completion_tokens` wins over its deprecated
`max_tokens`, chat `logprobs: true` with `top_logprobs: k` asks for k alternatives, and a
completion's `echo` with `logprobs` also asks for the prompt's logprobs. `SamplingParams`
validates every value; its `ValueError` names the field, so the caller answers 400 with it.
"""

from __future__ import annotations

from typing import Any

from fleetserve.engine.generation_config import GenerationDefaults
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from fleetserve.server.serving_structured import structured_outputs_of

__all__ = ["chat_sampling_params", "completion_sampling_params"]


def completion_sampling_params(
    body: CompletionRequest, defaults: GenerationDefaults | None = None
) -> SamplingParams:
    """The params of a completions request (each prompt of a batch gets the same); fields the
    body leaves unset come from `defaults` (`--generation-config`), then OpenAI's.

    Raises:
        ValueError: a field is out of range (the message starts with its name).
    """
    defaults = defaults or GenerationDefaults()
    prompt_logprobs = body.logprobs if body.echo else None
    max_tokens = body.max_tokens
    if "max_tokens" not in body.model_fields_set and defaults.max_tokens is not None:
        max_tokens = defaults.max_tokens
    return _sampling_params(body, max_tokens, body.logprobs, prompt_logprobs, defaults)


def chat_sampling_params(
    body: ChatCompletionRequest,
    default_max_tokens: int,
    defaults: GenerationDefaults | None = None,
) -> SamplingParams:
    """The params of a chat request; `default_max_tokens` (the context left after the prompt,
    capped by the `defaults`' max_tokens) applies when the body sets no limit.

    Raises:
        ValueError: a field is out of range, or `top_logprobs` without `logprobs`.
    """
    defaults = defaults or GenerationDefaults()
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, defaults.max_tokens or default_max_tokens)
    if body.top_logprobs is not None and not body.logprobs:
        raise ValueError("top_logprobs requires logprobs to be true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _sampling_params(body, max_tokens, logprobs, None, defaults)


def _sampling_params(
    body: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    defaults: GenerationDefaults,
) -> SamplingParams:
    logit_bias: dict[int, float] | None = None
    if body.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in body.logit_bias.items()}
        except ValueError as exc:
            raise ValueError("logit_bias keys must be token ids (integers)") from exc
    return SamplingParams(
        n=body.n,
        temperature=_first(body.temperature, defaults.temperature, 1.0),
        top_p=_first(body.top_p, defaults.top_p, 1.0),
        top_k=_first(body.top_k, defaults.top_k, 0),
        min_p=_first(body.min_p, defaults.min_p, 0.0),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=_first(body.repetition_penalty, defaults.repetition_penalty, 1.0),
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured_outputs=structured_outputs_of(body),
    )


def _first(request: Any, default: Any, neutral: Any) -> Any:
    """The request's value, else the generation config's, else OpenAI's neutral one."""
    if request is not None:
        return request
    return neutral if default is None else default
