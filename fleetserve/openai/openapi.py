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


def openapi_schema(title: str = "fleetserve") -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-serialisable dict); `title` names the served model."""
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
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"fleetserve: {title}", "version": "1"},
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
            "schemas": defs["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
