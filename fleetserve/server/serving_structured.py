"""Structured output at the HTTP boundary: the body's constraint fields → one
`StructuredOutputsParams`, and a forced tool call's output → OpenAI `tool_calls`.

The constraint fields (any one of them, never two): `response_format` (`json_object`,
`json_schema`), `structured_outputs` (vLLM's object), `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, and on chat `tools` with `tool_choice: "required"` (the
output is a JSON array of `{"name", "parameters"}` calls, at least one) or a named function (the
output is that function's arguments object).
"""

from __future__ import annotations

import json
from typing import Any

from fleetserve.engine.structured_output.params import StructuredOutputsParams
from fleetserve.openai.protocol import (
    ChatCompletionRequest,
    ChatTool,
    FunctionCall,
    NamedToolChoice,
    SamplingRequest,
    ToolCall,
)

__all__ = ["parse_tool_calls", "structured_outputs_of"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def structured_outputs_of(body: SamplingRequest) -> StructuredOutputsParams | None:
    """The body's output constraint, or None.

    Raises:
        ValueError: two constraints at once, or a malformed one; the message starts with the
            field's name (`response_format`, `structured_outputs.json`, `tool_choice`, ...).
    """
    given: list[tuple[str, StructuredOutputsParams]] = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        given.append(("response_format", StructuredOutputsParams.create(json_object=True)))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise ValueError(
                "response_format.json_schema.schema is required when response_format.type is "
                "'json_schema'"
            )
        given.append(
            (
                "response_format",
                _checked("response_format.json_schema.schema", json=spec.json_schema),
            )
        )
    if body.structured_outputs is not None:
        try:
            params = StructuredOutputsParams.from_dict(body.structured_outputs)
        except TypeError as exc:
            raise ValueError(f"structured_outputs is malformed: {exc}") from exc
        given.append(("structured_outputs", params))
    guided = {
        "guided_json": ("json", body.guided_json),
        "guided_regex": ("regex", body.guided_regex),
        "guided_choice": ("choice", body.guided_choice),
        "guided_grammar": ("grammar", body.guided_grammar),
    }
    for name, (kind, value) in guided.items():
        if value is not None:
            given.append((name, _checked(name, **{kind: value})))
    if isinstance(body, ChatCompletionRequest):
        tools = _tool_constraint(body)
        if tools is not None:
            given.append(("tool_choice", tools))
    if len(given) > 1:
        names = [name for name, _ in given]
        raise ValueError(f"{names[1]}: at most one output constraint per request, got {names}")
    return given[0][1] if given else None


def _checked(name: str, **params: Any) -> StructuredOutputsParams:
    """Build one constraint; its error names the body's field instead of the engine's."""
    try:
        return StructuredOutputsParams.create(**params)
    except ValueError as exc:
        message = str(exc)
        for kind in ("json", "regex", "choice", "grammar"):
            message = message.replace(f"structured_outputs.{kind}", name)
        raise ValueError(message) from exc


def _tool_constraint(body: ChatCompletionRequest) -> StructuredOutputsParams | None:
    if body.tool_choice not in (None, "none") and not body.tools:
        raise ValueError("tool_choice needs tools: give the functions it may call in tools")
    forced = body.forced_tools
    if forced is None:
        return None
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        if not forced:
            names = [t.function.name for t in body.tools or []]
            raise ValueError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools "
                f"({names})"
            )
        return _checked("tools.function.parameters", json=_parameters(forced[0]))
    schema = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": _parameters(tool),
                    },
                    "required": ["name", "parameters"],
                }
                for tool in forced
            ]
        },
    }
    return _checked("tools.function.parameters", json=schema)


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def parse_tool_calls(body: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """The forced call(s) in a chat output, or None when the body forces none or the output
    is not a complete call (cut by max_tokens: the text is returned as content instead)."""
    forced = body.forced_tools
    if not forced:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(body.tool_choice, NamedToolChoice):
        if not isinstance(value, dict):
            return None
        return [ToolCall(function=FunctionCall(name=forced[0].function.name, arguments=text))]
    if not isinstance(value, list) or not all(
        isinstance(call, dict) and isinstance(call.get("name"), str) for call in value
    ):
        return None
    return [
        ToolCall(
            function=FunctionCall(
                name=call["name"], arguments=json.dumps(call.get("parameters", {}))
            )
        )
        for call in value
    ]
