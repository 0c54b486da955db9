"""OpenAI request bodies → SamplingParams, and the error helpers (no server needed)."""

from __future__ import annotations

import pytest

from fleetserve.server.errors import value_error
from fleetserve.server.protocol import ChatCompletionRequest, CompletionRequest


def test_completion_request_maps_openai_and_vllm_fields() -> None:
    body = CompletionRequest.model_validate({
        "prompt": ["hi"], "max_tokens": 5, "temperature": 0, "stop": "\n", "seed": 3, "n": 2,
        "logprobs": 2, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1,
        "ignore_eos": True, "logit_bias": {"17": 2.5}, "user": "u", "unknown_field": 1,
    })  # fmt: skip
    assert body.prompt_list() == ["hi"]
    params = body.to_sampling_params()
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


def test_chat_request_token_limits_and_logprobs() -> None:
    messages = [{"role": "user", "content": "x"}]
    body = ChatCompletionRequest.model_validate({"messages": messages})
    assert body.to_sampling_params(100).max_tokens == 100  # the room left in the context
    body = ChatCompletionRequest.model_validate(
        {"messages": messages, "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True,
         "top_logprobs": 3}
    )  # fmt: skip
    params = body.to_sampling_params(100)
    assert (params.max_tokens, params.logprobs) == (4, 3)
    assert (
        ChatCompletionRequest.model_validate({"messages": messages, "logprobs": True})
        .to_sampling_params(10)
        .logprobs
        == 0
    )
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest.model_validate(
            {"messages": messages, "top_logprobs": 3}
        ).to_sampling_params(10)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("a", ["a"]), ([5, 6], [[5, 6]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_list_accepts_one_prompt_or_a_batch(prompt: object, expected: object) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt_list() == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": []}, "prompt must not be empty"),
        ({"prompt": ""}, "must not be empty"),
        ({"prompt": ["a", ""]}, "nor hold an empty prompt"),
        ({"prompt": [[1], []]}, "nor hold an empty prompt"),
        ({"prompt": "a", "suffix": "b"}, "suffix is not supported"),
        ({"prompt": "a", "echo": True, "logprobs": 1, "n": 2}, "echo with logprobs needs n=1"),
    ],
)
def test_prompt_list_refuses_empty_prompts_and_unsupported_fields(
    body: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CompletionRequest.model_validate(body).prompt_list()


def test_value_error_names_the_field() -> None:
    error = value_error(ValueError("max_tokens must be an integer >= 1 or None, got -1"))
    assert (error.status, error.param) == (400, "max_tokens")
    assert value_error(ValueError("Prompt is too long"), "prompt").param == "prompt"
