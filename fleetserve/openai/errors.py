"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a traceback.

Handlers raise `RequestError`; `error_middleware` turns it (and aiohttp's own HTTP errors, and
any unexpected exception) into the JSON body with the right status. `make_auth_middleware`
enforces the optional bearer token on the `/v1` routes. aiohttp and pydantic only: the router
answers with the same bodies.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import BaseModel, ValidationError

from fleetserve.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class RequestError(Exception):
    """An error answered to the client with `status` and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def to_response(self) -> web.Response:
        return error_response(
            self.status, self.message, param=self.param, code=self.code,
            retry_after_s=self.retry_after_s,
        )  # fmt: skip


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> str:
    info = ErrorInfo(
        message=message,
        type=_ERROR_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code if code is not None else str(status),
    )
    return ErrorResponse(error=info).model_dump_json()


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after_s: int | None = None,
) -> web.Response:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return web.Response(
        status=status,
        text=error_body(status, message, param, code),
        content_type="application/json",
        headers=headers,
    )


async def parse_body(request: web.Request, model: type[M]) -> M:
    """Read the JSON body into `model`.

    Raises:
        RequestError: 400 for malformed JSON, a non-object body or a schema violation; the
            message and `param` name the offending field.
    """
    raw = await request.read()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        # NOTE: JSON may escape a lone UTF-16 surrogate ("\ud800"), which is no Unicode text:
        # refused here, it cannot fail later in a tokenizer or on the way to the engine core.
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise RequestError(
            400, "the request body holds invalid Unicode (an unpaired UTF-16 surrogate escape)"
        ) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        # NOTE: `param` is the top-level field; the message keeps the full path (union members,
        # list indices) so the client sees exactly what failed.
        param = loc[0] if loc else None
        if first["type"] == "value_error":
            # NOTE: our validators' messages already name the allowed values and the value given;
            # pydantic's "Value error, " prefix and a second "got" would only repeat them.
            message = f"{'.'.join(loc)}: {first.get('ctx', {}).get('error', first['msg'])}"
        else:
            message = f"{'.'.join(loc)}: {first['msg']}"
            given = first.get("input")
            if isinstance(given, str | int | float | bool):
                message += f", got {repr(given)[:100]}"
        raise RequestError(400, message, param=param) from exc


def value_error(exc: ValueError, default_param: str | None = None) -> RequestError:
    """A 400 for a `ValueError` whose message starts with the field name (our convention)."""
    message = str(exc)
    first_word = message.split(" ", 1)[0].rstrip(":")
    param = first_word if first_word.isidentifier() and first_word.islower() else default_param
    return RequestError(400, message, param=param)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:
        return exc.to_response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason or HTTPStatus(exc.status).phrase)
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(500, "internal server error")


def make_auth_middleware(api_key: str) -> Middleware:
    """Require `Authorization: Bearer <api_key>` on every `/v1` route (as vLLM does)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error_response(401, "invalid or missing API key", code="invalid_api_key")
        return await handler(request)

    return auth_middleware
