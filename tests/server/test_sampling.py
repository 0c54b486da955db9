"""OpenAI request bodies → SamplingParams (`fleetserve/server/sampling.py`)."""

from __future__ import annotations

import pytest

from fleetserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.server.sampling import chat_sampling_params, completion_sampling_params


def test_completion_request_maps_openai_and_vllm_fields() -> None:
    body = CompletionRequest.model_validate({
        "prompt": ["hi"], "max_tokens": 5, "temperature": 0, "stop": "\n", "seed": 3, "n": 2,
        "logprobs": 2, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1,
        "ignore_eos": True, "logit_bias": {"17": 2.5}, "user": "u", "unknown_field": 1,
    })  # fmt: skip
    params = completion_sampling_params(body)
    assert (params.max_tokens, params.temperature, params.stop, params.seed, params.n) == (
        5,
        0.0,
        ["\n"],
        3,
        2,
    )
    assert (params.logprobs, params.top_k, params.min_p, params.repetition_penalty) == (
        2,
        4,
        0.1,
        1.2,
    )
    assert params.min_tokens == 1 and params.ignore_eos and params.logit_bias == {17: 2.5}
    assert params.prompt_logprobs is None
    defaults = completion_sampling_params(CompletionRequest.model_validate({"prompt": "a"}))
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (1, 1, 0, 0)
    assert (defaults.max_tokens, defaults.repetition_penalty) == (16, 1.0)


def test_echo_with_logprobs_asks_for_the_prompt_logprobs() -> None:
    body = CompletionRequest.model_validate({"prompt": "a", "echo": True, "logprobs": 3})
    assert completion_sampling_params(body).prompt_logprobs == 3


def test_chat_request_token_limits_and_logprobs() -> None:
    messages = [{"role": "user", "content": "x"}]
    body = ChatCompletionRequest.model_validate({"messages": messages})
    assert chat_sampling_params(body, 100).max_tokens == 100  # the room left in the context
    body = ChatCompletionRequest.model_validate(
        {"messages": messages, "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True,
         "top_logprobs": 3}
    )  # fmt: skip
    params = chat_sampling_params(body, 100)
    assert (params.max_tokens, params.logprobs) == (4, 3)
    body = ChatCompletionRequest.model_validate({"messages": messages, "max_tokens": 9})
    assert chat_sampling_params(body, 100).max_tokens == 9
    body = ChatCompletionRequest.model_validate({"messages": messages, "logprobs": True})
    assert chat_sampling_params(body, 10).logprobs == 0
    with pytest.raises(ValueError, match="top_logprobs"):
        chat_sampling_params(
            ChatCompletionRequest.model_validate({"messages": messages, "top_logprobs": 3}), 10
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -2}, "temperature"),
        ({"top_p": 7}, "top_p"),
    ],
)
def test_bad_values_raise_value_errors_naming_the_field(
    fields: dict[str, object], message: str
) -> None:
    body = CompletionRequest.model_validate({"prompt": "a", **fields})
    with pytest.raises(ValueError, match=message):
        completion_sampling_params(body)
