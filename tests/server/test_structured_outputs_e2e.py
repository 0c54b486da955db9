"""Structured output through a real `fleetserve serve` process on the bundled SmolLM2, with the
official `openai` client (issue 20, acceptance 1): every answer under a JSON schema validates
(jsonschema), regex and choice hold, a forced tool call has parseable arguments, a bad schema
is a 400, and a grammar that compiles slowly delays nobody (asserted as an order, not a time)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.server.server_process import API_KEY, ServerHandle, start_server

pytestmark = pytest.mark.slow

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"],
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 4}},
        "required": ["tags"],
    },
    "bounded numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["age", "score", "count"],
    },
}  # fmt: skip
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    yield from start_server(tmp_path_factory.mktemp("structured"), max_model_len=1024)


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def _chat(client: openai.OpenAI, server: ServerHandle, content: str, **kwargs):
    return client.chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": content}], **kwargs
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_under_a_json_schema_validates(
    client: openai.OpenAI, server: ServerHandle, name: str
) -> None:
    schema = SCHEMAS[name]
    answers = [
        _chat(client, server, f"Describe one example as JSON ({name}).", max_tokens=200,
              temperature=temperature, seed=seed,
              response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        for temperature, seed in ((0.0, None), (0.8, 1), (0.8, 2))
    ]  # fmt: skip
    for answer in answers:
        (choice,) = answer.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_a_streamed_answer_under_a_schema_validates(
    client: openai.OpenAI, server: ServerHandle
) -> None:
    schema = SCHEMAS["nested"]
    stream = _chat(client, server, "A person with an address, as JSON.", max_tokens=200,
                   temperature=0, stream=True,
                   response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_completions_with_a_schema_and_json_object(
    client: openai.OpenAI, server: ServerHandle
) -> None:
    schema = SCHEMAS["enum"]
    answer = client.completions.create(
        model=server.model_name, prompt="A T-shirt as JSON:", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(answer.choices[0].text), schema)
    answer = _chat(client, server, "Give me a JSON object about a cat.", max_tokens=200,
                   temperature=0, response_format={"type": "json_object"})  # fmt: skip
    if answer.choices[0].finish_reason == "stop":  # an open-ended object may run to max_tokens
        assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)
    else:
        assert (answer.choices[0].message.content or "").lstrip().startswith("{")


def test_regex_and_choice_hold(client: openai.OpenAI, server: ServerHandle) -> None:
    for seed in (1, 2, 3):
        answer = client.completions.create(
            model=server.model_name, prompt="Call me at", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"},
        )  # fmt: skip
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", answer.choices[0].text), answer.choices[0]
        choices = ["positive", "negative", "neutral"]
        answer = _chat(client, server, "Sentiment of 'I love it'?", max_tokens=10, temperature=1.0,
                       seed=seed, extra_body={"guided_choice": choices})  # fmt: skip
        assert answer.choices[0].message.content in choices
        answer = _chat(client, server, "Yes or no?", max_tokens=10, temperature=1.0, seed=seed,
                       extra_body={"structured_outputs": {"regex": "(yes|no)!"}})  # fmt: skip
        assert answer.choices[0].message.content in ("yes!", "no!")


def test_tool_choice_required_returns_parseable_arguments(
    client: openai.OpenAI, server: ServerHandle
) -> None:
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = _chat(client, server, "What is the weather in Paris?", max_tokens=120,
                       temperature=0, tools=[TOOL], tool_choice=tool_choice)  # fmt: skip
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])


def test_an_invalid_schema_is_a_400_naming_the_problem(
    client: openai.OpenAI, server: ServerHandle
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, server, "x", max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})  # fmt: skip
    assert "not a valid JSON schema" in str(caught.value) and "objekt" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        # valid JSON Schema, but not something the grammar backend compiles
        client.completions.create(model=server.model_name, prompt="x", max_tokens=5,
                                  extra_body={"guided_regex": "(?<=a)b"})  # fmt: skip
    assert "does not compile" in str(caught.value)


def _huge_schema() -> dict:
    fields = {
        f"field_{i}": {
            "type": "object",
            "properties": {f"sub_{j}": {"type": "string", "pattern": "[a-z]{3,9}[0-9]{2}"}
                           for j in range(20)},
            "required": [f"sub_{j}" for j in range(20)],
        }
        for i in range(60)
    }  # fmt: skip
    return {"type": "object", "properties": fields, "required": list(fields)}


def test_a_slow_grammar_compile_delays_nobody(
    client: openai.OpenAI, server: ServerHandle, tmp_path: Path
) -> None:
    finished: list[str] = []
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            client.completions.create(
                model=server.model_name, prompt="x", max_tokens=4, temperature=0,
                extra_body={"guided_json": _huge_schema()}, timeout=300,
            )  # fmt: skip
            finished.append("slow")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=slow)
    thread.start()
    # NOTE: wait until the core holds the slow request (it counts as waiting while it compiles)
    deadline = time.monotonic() + 30
    while server.metrics().get("vllm:num_requests_waiting", 0) < 1:
        assert time.monotonic() < deadline and thread.is_alive(), errors
        time.sleep(0.05)

    # NOTE: the compile holds one of the machine's cores (it releases the GIL, but the CPU is
    # shared), so the plain requests go together: one batch, not three latencies in a row that
    # a busy 2-core machine can stretch past the compile.
    def plain() -> None:
        client.completions.create(
            model=server.model_name, prompt="Hello", max_tokens=8, temperature=0
        )
        finished.append("plain")

    with ThreadPoolExecutor(3) as pool:
        for future in [pool.submit(plain) for _ in range(3)]:
            future.result()
    thread.join(300)
    assert not errors, errors
    assert finished == ["plain", "plain", "plain", "slow"]
