"""The OpenAI error helpers on their own (the HTTP behaviour is in tests/server/)."""

from __future__ import annotations

import json

from fleetserve.openai.errors import RequestError, error_body, value_error


def test_value_error_names_the_field() -> None:
    error = value_error(ValueError("max_tokens must be an integer >= 1 or None, got -1"))
    assert (error.status, error.param) == (400, "max_tokens")
    assert value_error(ValueError("Prompt is too long"), "prompt").param == "prompt"


def test_error_body_is_openai_shaped() -> None:
    assert json.loads(error_body(429, "slow down")) == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "429"}
    }
    response = RequestError(503, "gone", retry_after_s=5).to_response()
    assert response.status == 503 and response.headers["Retry-After"] == "5"
    body = json.loads(response.text or "")
    assert body["error"]["type"] == "service_unavailable"
