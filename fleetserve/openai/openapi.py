"""The OpenAPI 3.1 document of the engine server's HTTP API, generated from the protocol models.

`openapi_schema()` is what `GET /openapi.json` serves: every route with its request body and
its responses, the bodies' JSON Schemas taken from the pydantic models in `protocol.py` (so
the document cannot drift from what the server validates), errors as `ErrorResponse`. Clients
generate from it and the suite's property-based fuzzer (tests/server/test_fuzz.py) draws its
requests from it. Torch-free and engine-free, like the rest of the package.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from fleetserve.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = ["openapi_schema"]

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "Bad input: the message names the field (`param`).",
    "401": "Missing or wrong API key.",
    "408": "The client read a stream too slowly; the request was aborted.",
    "429": "Overloaded: too many sequences wait; retry after `Retry-After` seconds.",
    "500": "The engine failed this request.",
    "503": "The engine cannot serve (it died); retry after `Retry-After` seconds.",
}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}


def _operation(
    summary: str,
    response: type[BaseModel],
    request: type[BaseModel] | None = None,
    *,
    stream: bool = False,
    auth: bool = True,
) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "OK", "content": _json(response)}
    if stream:
        ok["content"]["text/event-stream"] = {
            "schema": {"type": "string", "description": "`data: {chunk}` events, `data: [DONE]`"}
        }
    responses: dict[str, Any] = {"200": ok}
    for status, description in _ERRORS.items():
        if status == "401" and not auth:
            continue
        responses[status] = {"description": description, "content": _json(ErrorResponse)}
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": _json(request)}
    if auth:
        operation["security"] = [{"bearer": []}]
    return operation


def _bound_token_ids(schemas: dict[str, Any], vocab_size: int) -> None:
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    ids = {"type": "array", "items": token_id, "minItems": 1}
    completion = schemas["CompletionRequest"]["properties"]
    completion["prompt"]["anyOf"] = [
        {"type": "string", "minLength": 1},
        ids,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": ids, "minItems": 1},
    ]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        stop_ids = schemas[name]["properties"]["stop_token_ids"]
        stop_ids["anyOf"] = [{"type": "array", "items": token_id}, {"type": "null"}]
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = token_id


def openapi_schema(
    model_name: str = "fleetserve",
    max_model_len: int | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-serialisable dict) of a server of `model_name`.

    The request schemas say what this server takes: `model` is its name (or absent); with
    `max_model_len`, a completion's token limits are at most that; with `vocab_size`, token
    ids (prompts, stop_token_ids, /detokenize) are in [0, vocab_size).
    """
    models: list[type[BaseModel]] = [
        CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
    ]  # fmt: skip
    outputs: list[type[BaseModel]] = [
        CompletionResponse, ChatCompletionResponse, TokenizeResponse, DetokenizeResponse,
        ModelList, ErrorResponse,
    ]  # fmt: skip
    _, defs = models_json_schema(
        [(m, "validation") for m in models] + [(m, "serialization") for m in outputs],
        ref_template=_REF,
    )
    schemas = defs["$defs"]
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
    ):
        properties = schemas[name]["properties"]
        properties["model"] = {"anyOf": [{"enum": [model_name]}, {"type": "null"}], "default": None}
        for field in ("max_tokens", "max_completion_tokens"):
            if max_model_len is not None and field in properties:
                properties[field]["maximum"] = max_model_len
    if vocab_size is not None:
        _bound_token_ids(schemas, vocab_size)
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"fleetserve: {model_name}", "version": "1"},
        "paths": {
            "/v1/completions": {
                "post": _operation(
                    "Text completion", CompletionResponse, CompletionRequest, stream=True
                )
            },
            "/v1/chat/completions": {
                "post": _operation(
                    "Chat completion", ChatCompletionResponse, ChatCompletionRequest, stream=True
                )
            },
            "/v1/models": {"get": _operation("The served model", ModelList)},
            "/tokenize": {
                "post": _operation("Tokenize", TokenizeResponse, TokenizeRequest, auth=False)
            },
            "/detokenize": {
                "post": _operation("Detokenize", DetokenizeResponse, DetokenizeRequest, auth=False)
            },
            "/health": {
                "get": {
                    "summary": "200 while the engine can serve",
                    "responses": {
                        "200": {"description": "Healthy"},
                        "503": {"description": "Unhealthy", "content": _json(ErrorResponse)},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "OK", "content": text}},
                }
            },
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
