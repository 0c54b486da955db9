"""The OpenAI bodies on their own: faithful fields, unknown ones ignored, prompt batches, and
that the protocol package loads without torch or the engine (the router imports it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetserve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)


def test_protocol_and_errors_import_without_torch_or_the_engine() -> None:
    code = (
        "import sys, fleetserve.openai.protocol, fleetserve.openai.errors\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'triton', 'transformers') or m.startswith(('fleetserve.engine', "
        "'fleetserve.server', 'fleetserve.kernels')))\n"
        "print(loaded)\n"
        "assert 'torch' not in sys.modules\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "[]"


def test_request_bodies_keep_openai_and_vllm_fields_and_ignore_unknown_ones() -> None:
    body = CompletionRequest.model_validate({
        "prompt": ["hi"], "max_tokens": 5, "temperature": 0, "stop": "\n", "seed": 3, "n": 2,
        "logprobs": 2, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1,
        "ignore_eos": True, "logit_bias": {"17": 2.5}, "user": "u", "unknown_field": 1,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    })  # fmt: skip
    assert (body.max_tokens, body.temperature, body.stop, body.seed, body.n) == (5, 0, "\n", 3, 2)
    assert (body.logprobs, body.top_k, body.min_p, body.repetition_penalty) == (2, 4, 0.1, 1.2)
    assert body.logit_bias == {"17": 2.5} and body.ignore_eos and body.min_tokens == 1
    assert "unknown_field" not in body.model_dump()
    assert body.include_usage_in_stream and body.continuous_usage_in_stream
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4,
         "logprobs": True, "top_logprobs": 3, "whatever": {"nested": True}}
    )  # fmt: skip
    assert (chat.max_completion_tokens, chat.max_tokens, chat.logprobs, chat.top_logprobs) == (
        4,
        None,
        True,
        3,
    )
    assert not chat.include_usage_in_stream
    # Defaults are OpenAI's: completions default to 16 tokens, chat to no limit.
    assert CompletionRequest.model_validate({"prompt": "a"}).max_tokens == 16
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user"}]}).max_tokens is None


def test_response_bodies_round_trip_and_omit_nothing() -> None:
    response = CompletionResponse(
        id="cmpl-1",
        model="m",
        choices=[CompletionResponseChoice(index=0, text="x", finish_reason="stop", stop_reason=2)],
    )
    data = response.model_dump()
    assert data["object"] == "text_completion"
    assert data["choices"][0] == {
        "index": 0, "text": "x", "logprobs": None, "finish_reason": "stop", "stop_reason": 2,
        "prompt_token_ids": None, "token_ids": None,
    }  # fmt: skip
    assert CompletionResponse.model_validate_json(response.model_dump_json()) == response


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
