"""OpenAI request bodies → the engine's `SamplingParams` (the one place the two meet).

OpenAI's defaults and names map onto vLLM's: an absent `temperature`/`top_p` is 1, `top_k`
and `min_p` absent are off, chat's `max_completion_tokens` wins over its deprecated
`max_tokens`, chat `logprobs: true` with `top_logprobs: k` asks for k alternatives, and a
completion's `echo` with `logprobs` also asks for the prompt's logprobs. `SamplingParams`
validates every value; its `ValueError` names the field, so the caller answers 400 with it.
"""

from __future__ import annotations

from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from fleetserve.server.serving_structured import structured_outputs_of

__all__ = ["chat_sampling_params", "completion_sampling_params"]


def completion_sampling_params(body: CompletionRequest) -> SamplingParams:
    """The params of a completions request (each prompt of a batch gets the same).

    Raises:
        ValueError: a field is out of range (the message starts with its name).
    """
    prompt_logprobs = body.logprobs if body.echo else None
    return _sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs)


def chat_sampling_params(body: ChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
    """The params of a chat request; `default_max_tokens` (the context left after the prompt)
    applies when the body sets no limit.

    Raises:
        ValueError: a field is out of range, or `top_logprobs` without `logprobs`.
    """
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise ValueError("top_logprobs requires logprobs to be true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _sampling_params(body, max_tokens, logprobs)


def _sampling_params(
    body: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    logit_bias: dict[int, float] | None = None
    if body.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in body.logit_bias.items()}
        except ValueError as exc:
            raise ValueError("logit_bias keys must be token ids (integers)") from exc
    return SamplingParams(
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
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
