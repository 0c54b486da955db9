from __future__ import annotations

import pytest
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.operator.errors import (
    OTHER_RETRY_DELAY_S,
    RETRY_DELAYS_S,
    SpecProblem,
    is_moot,
    is_transient,
    retry_delay_s,
    spec_problem,
)


def _api_error(status: int, headers: dict[str, str] | None = None) -> ApiException:
    exc = ApiException(status=status, reason="r", body='{"message": "m"}')
    exc.headers = headers
    return exc


def _validation_error() -> ValidationError:
    with pytest.raises(ValidationError) as info:
        InferenceDeploymentSpec.model_validate(
            {
                "model": {"name": "m", "source": {"uri": "/m"}, "dtype": "int4"},
                "roles": {"prefill": {}, "decode": {"replicas": -1}},
            }
        )
    return info.value


def test_a_spec_that_fails_validation_is_permanent_and_names_the_fields() -> None:
    problem = spec_problem(_validation_error())
    assert problem is not None and problem.reason == "InvalidSpec"
    assert "spec.model.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'" in (
        problem.message
    )
    assert "spec.roles.decode.replicas: Input should be greater than or equal to 0" in (
        problem.message
    )


def test_builder_value_errors_and_rejected_children_are_permanent() -> None:
    assert spec_problem(ValueError("model.source.uri must be ...")) == SpecProblem(
        "InvalidSpec", "model.source.uri must be ..."
    )
    for status in (400, 422):
        problem = spec_problem(_api_error(status))
        assert problem is not None and problem.reason == "ChildRejected"
        assert problem.message == 'the API server rejected a child: {"message": "m"}'
    for exc in (_api_error(500), _api_error(409), _api_error(403), RuntimeError("bug")):
        assert spec_problem(exc) is None


@pytest.mark.parametrize("status", [0, 409, 429, 500, 502, 503, 504])
def test_overload_conflicts_and_the_network_are_transient(status: int) -> None:
    assert is_transient(_api_error(status))
    assert [retry_delay_s(_api_error(status), n) for n in range(8)] == [
        *RETRY_DELAYS_S,
        RETRY_DELAYS_S[-1],
        RETRY_DELAYS_S[-1],
    ]


def test_connection_errors_are_transient() -> None:
    for exc in (
        urllib3.exceptions.MaxRetryError(None, "/x", None),  # type: ignore[arg-type]
        urllib3.exceptions.ProtocolError("reset"),
        ConnectionRefusedError(),
        TimeoutError(),
    ):
        assert is_transient(exc), exc
        assert retry_delay_s(exc, 0) == RETRY_DELAYS_S[0]


def test_retry_after_is_honoured_and_bounded() -> None:
    assert retry_delay_s(_api_error(429, {"Retry-After": "7"}), 0) == 7.0
    assert retry_delay_s(_api_error(503, {"Retry-After": "100000"}), 3) == 300.0
    assert retry_delay_s(_api_error(503, {"Retry-After": "soon"}), 1) == RETRY_DELAYS_S[1]


def test_other_failures_are_retried_slowly() -> None:
    for exc in (_api_error(403), _api_error(404), RuntimeError("bug"), AssertionError()):
        assert not is_transient(exc)
        assert retry_delay_s(exc, 0) == OTHER_RETRY_DELAY_S


def test_a_write_into_a_terminating_namespace_is_moot() -> None:
    body = (
        '{"kind":"Status","status":"Failure","reason":"Forbidden","code":403,"details":{"name":'
        '"d-prefill-0","kind":"services","causes":[{"reason":"NamespaceTerminating","message":'
        '"namespace ns is being terminated","field":"metadata.namespace"}]}}'
    )
    assert is_moot(ApiException(status=403, reason="Forbidden", body=body))
    assert not is_moot(ApiException(status=403, reason="Forbidden", body='{"reason":"Forbidden"}'))
    assert not is_moot(ApiException(status=403, reason="Forbidden", body="not json"))
    assert not is_moot(ApiException(status=500, reason="x", body=body))
    assert not is_moot(RuntimeError("bug"))
