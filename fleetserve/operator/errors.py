"""Error policy of a reconcile (review guideline 13), as pure functions.

Two kinds of failure, with kopf's semantics:

- permanent (kopf's `PermanentError`): the spec cannot be realised: it fails
  `InferenceDeploymentSpec` validation, a builder raises `ValueError` (a bad model URI, roles
  whose KV formats cannot pair), or the API server rejects a rendered child as invalid (400/422).
  The reconcile writes phase `Failed` with a Ready=False condition saying why and posts a Warning
  event; nothing retries until the spec changes.
- temporary (kopf's `TemporaryError` with a delay): the API server is briefly unable (409
  conflict, 429, 5xx) or unreachable (connection errors). The reconcile is retried after
  `retry_delay_s`, honouring the server's Retry-After.

A write refused because the namespace is being deleted is moot (`is_moot`): the object is going
away with it, so nothing is retried. Anything else (a 403 from missing RBAC, a bug) is retried
too, but slowly, like kopf's default for arbitrary exceptions: the operator cannot fix it, a
person may.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

__all__ = [
    "OTHER_RETRY_DELAY_S",
    "RETRY_DELAYS_S",
    "TRANSIENT_STATUSES",
    "SpecProblem",
    "is_moot",
    "is_transient",
    "retry_delay_s",
    "spec_problem",
]

TRANSIENT_STATUSES = frozenset({409, 429, 500, 502, 503, 504})
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Delay before the n-th retry of a temporary failure (the last one repeats)."""
OTHER_RETRY_DELAY_S = 60.0
"""Delay before retrying a failure that is neither a spec problem nor a transient one."""
MAX_RETRY_AFTER_S = 300.0


@dataclass(frozen=True, slots=True)
class SpecProblem:
    """Why a spec cannot be realised: the Ready condition's reason and message."""

    reason: str
    message: str


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"] if p != "__root__")
        parts.append(f"spec.{where}: {err['msg']}" if where else f"spec: {err['msg']}")
    return "; ".join(parts)


def spec_problem(exc: BaseException) -> SpecProblem | None:
    """The permanent problem `exc` reports, or None when retrying could help."""
    if isinstance(exc, ValidationError):
        return SpecProblem("InvalidSpec", _validation_message(exc))
    if isinstance(exc, ValueError):
        return SpecProblem("InvalidSpec", str(exc))
    if isinstance(exc, ApiException) and exc.status in (400, 422):
        return SpecProblem("ChildRejected", f"the API server rejected a child: {_api_detail(exc)}")
    return None


def _api_detail(exc: ApiException) -> str:
    return str(exc.body or exc.reason or f"HTTP {exc.status}")


def is_transient(exc: BaseException) -> bool:
    """True for failures that clear up on their own (API overload, conflicts, the network)."""
    if isinstance(exc, ApiException):
        # NOTE: status 0 is how the client reports a request that never got a response.
        return exc.status in TRANSIENT_STATUSES or exc.status == 0
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


def is_moot(exc: BaseException) -> bool:
    """True for a write refused because its namespace is being deleted (no point retrying)."""
    if not isinstance(exc, ApiException) or exc.status != 403:
        return False
    try:
        details = json.loads(exc.body or "{}").get("details") or {}
    except (ValueError, AttributeError):
        return False
    return any(c.get("reason") == "NamespaceTerminating" for c in details.get("causes") or [])


def _retry_after_s(exc: BaseException) -> float | None:
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER_S) if value is not None else None
    except ValueError:
        return None


def retry_delay_s(exc: BaseException, attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (0-based) after `exc`."""
    if not is_transient(exc):
        return OTHER_RETRY_DELAY_S
    after = _retry_after_s(exc)
    if after is not None:
        return after
    return RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
