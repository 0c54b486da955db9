"""The structured-output surface in-process (fake engine core): each OpenAI/vLLM field becomes
the one constraint the engine gets, malformed ones are 400s naming the problem, forced tool
calls come back as `tool_calls`, and a constraint the engine cannot compile is a 400."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleetserve.common.error_codes import INVALID_GRAMMAR
from fleetserve.engine.engine_client import EngineRequestError
from fleetserve.engine.structured_output.params import StructuredOutputsParams
from tests.server.fake_engine import FakeEngineClient, GenerateCall, token_outputs
from tests.server.test_serving_limits import CHAT, MakeApp, _post

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}  # fmt: skip


def _only_call(fake_engine: FakeEngineClient) -> GenerateCall:
    (call,) = fake_engine.calls
    return call


@pytest.mark.parametrize(
    ("path", "extra", "expected"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}},
         StructuredOutputsParams(json_object=True)),
        ("/v1/completions",
         {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
         StructuredOutputsParams.create(json=SCHEMA)),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "[0-9]+"}},
         StructuredOutputsParams(regex="[0-9]+")),
        ("/v1/completions", {"guided_json": SCHEMA}, StructuredOutputsParams.create(json=SCHEMA)),
        ("/v1/completions", {"guided_json": json.dumps(SCHEMA)},
         StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ("/v1/completions", {"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
        ("/v1/chat/completions", {"guided_choice": ["yes", "no"]},
         StructuredOutputsParams(choice=("yes", "no"))),
        ("/v1/completions", {"guided_grammar": 'root ::= "x"'},
         StructuredOutputsParams(grammar='root ::= "x"')),
        ("/v1/chat/completions", {"response_format": {"type": "text"}}, None),
    ],
)  # fmt: skip
def test_each_field_becomes_the_engines_constraint(
    make_app: MakeApp, fake_engine: FakeEngineClient, path: str, extra: Any, expected: Any
) -> None:
    body = {"messages": CHAT} if "chat" in path else {"prompt": "x"}
    status, data, _ = _post(make_app(), path, {**body, **extra})
    assert status == 200, data
    assert _only_call(fake_engine).params.structured_outputs == expected


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"guided_json": {"type": "strin"}}, ["guided_json", "not a valid JSON schema", "type"]),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"properties": {"a": {"minimum": "zero"}}}}}},
         ["response_format.json_schema.schema", "properties/a/minimum"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         ["response_format.json_schema.schema is required"]),
        ({"guided_regex": "[a-"}, ["guided_regex is not a valid regex"]),
        ({"guided_choice": []}, ["guided_choice must be a non-empty list"]),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, ["exactly one of"]),
        ({"structured_outputs": {"whitespace": "x"}}, ["unknown structured_outputs field"]),
        ({"guided_regex": "a", "guided_choice": ["b"]}, ["at most one output constraint"]),
        ({"response_format": {"type": "xml"}}, ["response_format"]),
    ],
)  # fmt: skip
def test_malformed_constraints_are_400s_naming_the_problem(
    make_app: MakeApp, fake_engine: FakeEngineClient, extra: Any, words: list[str]
) -> None:
    status, data, _ = _post(make_app(), "/v1/completions", {"prompt": "x", **extra})
    assert status == 400, data
    for word in words:
        assert word in data["error"]["message"], (word, data["error"]["message"])
    assert fake_engine.calls == []


def test_a_constraint_the_engine_cannot_compile_is_a_400(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    reason = f"{INVALID_GRAMMAR}: structured_outputs.grammar does not compile: EBNF parser error"
    fake_engine.script = lambda call: [
        EngineRequestError(f"the engine failed the request: {reason}")
    ]
    status, data, _ = _post(
        make_app(), "/v1/completions", {"prompt": "x", "guided_grammar": "root ::= "}
    )
    assert status == 400, data
    assert (
        data["error"]["code"] == INVALID_GRAMMAR and "EBNF parser error" in data["error"]["message"]
    )


def _scripted_text(fake_engine: FakeEngineClient, tokenizer: Any, text: str, finish: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    fake_engine.script = lambda call: token_outputs(call, [ids], tokenizer, finish_reason=finish)


def test_tool_choice_required_forces_a_call_array_and_answers_tool_calls(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    _scripted_text(fake_engine, tokenizer, text, "stop")
    body = {"messages": CHAT, "tools": [TOOL], "tool_choice": "required"}
    status, data, _ = _post(make_app(), "/v1/chat/completions", body)
    assert status == 200, data
    schema = json.loads(_only_call(fake_engine).params.structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    (choice,) = data["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_named_function_forces_its_arguments(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    _scripted_text(fake_engine, tokenizer, '{"city": "Oslo"}', "stop")
    other = {"type": "function", "function": {"name": "noop"}}
    body = {"messages": CHAT, "tools": [other, TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    status, data, _ = _post(make_app(), "/v1/chat/completions", body)
    assert status == 200, data
    params = _only_call(fake_engine).params.structured_outputs
    assert json.loads(params.json) == TOOL["function"]["parameters"]
    (call,) = data["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_a_call_cut_by_max_tokens_comes_back_as_text(
    make_app: MakeApp, fake_engine: FakeEngineClient, tokenizer: Any
) -> None:
    _scripted_text(fake_engine, tokenizer, '[{"name": "get_wea', "length")
    body = {"messages": CHAT, "tools": [TOOL], "tool_choice": "required", "max_tokens": 5}
    status, data, _ = _post(make_app(), "/v1/chat/completions", body)
    assert status == 200, data
    (choice,) = data["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == '[{"name": "get_wea'


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [TOOL]},
         ["nope", "not in tools"]),
        ({"tool_choice": "required"}, ["tool_choice needs tools"]),
        ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"},
         ["at most one output constraint"]),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(
    make_app: MakeApp, fake_engine: FakeEngineClient, extra: Any, words: list[str]
) -> None:
    status, data, _ = _post(make_app(), "/v1/chat/completions", {"messages": CHAT, **extra})
    assert status == 400, data
    for word in words:
        assert word in data["error"]["message"], (word, data["error"]["message"])


def test_tools_with_tool_choice_none_are_ignored(
    make_app: MakeApp, fake_engine: FakeEngineClient
) -> None:
    body = {"messages": CHAT, "tools": [TOOL], "tool_choice": "none"}
    status, data, _ = _post(make_app(), "/v1/chat/completions", body)
    assert status == 200, data
    assert _only_call(fake_engine).params.structured_outputs is None
    assert "tool_calls" not in data["choices"][0]["message"]
