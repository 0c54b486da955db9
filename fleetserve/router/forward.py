"""Forwarding one request through the fleet: decide, prefill remotely if so decided, open the
decode engine's answer; retries and breaker accounting as one design.

Contract (ARCHITECTURE.md, P/D request protocol):
- Prefill leg: the client's body with `kv_transfer_params: {"do_remote_decode": true}`,
  `max_tokens: 1`, `stream: false`; its answer's `kv_transfer_params` go to the decode engine
  with `do_remote_prefill: true`, on the client's body otherwise unchanged.
- A prefill failure (5xx, timeout, connection error, an answer without `kv_transfer_params`)
  counts against that prefill engine and is retried on another prefill engine or, with none
  left, decode-only (the decode engine computes the whole prompt). The decode leg is not sent
  before its prefill succeeded, so a failed prefill leaves no decode slot waiting.
- A client error from either leg (4xx other than 408/429: context too long, bad field) is
  answered as the engine wrote it and counts against nothing; a 429 moves to another engine.
- A decode failure before any byte reached the client is retried: a 5xx after a remote prefill
  counts against the (prefill, decode) pair (the transfer is suspect, the decode engine may be
  fine), connection errors and timeouts against the decode engine. A streamed answer is held
  back only up to its first output event (a chat role chunk at most), so an engine that fails
  before its first token (a KV load that failed) is still retried; once bytes reach the client
  nothing is replayed (`fleetserve.router.app` ends a broken stream with an error event). At
  most `MAX_ATTEMPTS` decisions per request.
- No usable decode engine: 503, unless a decode (or unified) engine is joining (discovered, its
  first scrape not answered yet; `Fleet.joining`). Then the request waits for the fleet to
  change, `join_wait_s` at most in all, and is decided again; the wait is no attempt. This is
  the moment of a roll when the operator has drained the old engine because the new one is
  Ready, and the router has not scraped the new one yet: a gap of a scrape's length that would
  otherwise fail every request arriving in it. Every engine saturated is a 429 at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from fleetserve.api.router_config import RouterConfig
from fleetserve.common.error_codes import KV_TRANSFER_FAILED
from fleetserve.openai.errors import error_body
from fleetserve.router.fleet import Fleet
from fleetserve.router.metrics import RouterMetrics
from fleetserve.router.policy import (
    DECODE_ROLES,
    Decision,
    NoEngineAvailable,
    RoutingPolicy,
    RoutingRequest,
)

__all__ = ["MAX_ATTEMPTS", "PATHS", "Answer", "Forwarder", "Stream"]

MAX_ATTEMPTS = 4
MAX_HELD_EVENTS = 4
MAX_HELD_BYTES = 1024 * 1024
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_BODY_BYTES = 64 * 1024 * 1024
_JSON = {"Content-Type": "application/json"}
_CLIENT_ERRORS_PASSED_ON = frozenset(range(400, 500)) - {408, 429}


@dataclass(frozen=True, slots=True)
class Answer:
    """A complete answer for the client (a buffered engine answer or the router's error)."""

    status: int
    body: bytes
    content_type: str = "application/json"
    retry_after_s: int | None = None


@dataclass(slots=True)
class Stream:
    """An open decode answer whose body the app streams to the client; `finish(outcome)` must
    be called once when it ends (True: complete, False: upstream broke, None: client left)."""

    upstream: aiohttp.ClientResponse
    finish: Callable[[bool | None], None]
    head: bytes = b""
    """The events already read from `upstream` (up to the first token), to be sent first."""


class _Failed(Exception):
    """An upstream attempt failed in a way that counts against the engine (or pair)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Busy(Exception):
    """The engine answered 429 (or its breaker's trial slot was taken): try another."""


def _error(status: int, message: str, retry_after_s: int | None = None) -> Answer:
    return Answer(status, error_body(status, message).encode(), retry_after_s=retry_after_s)


class Forwarder:
    """Runs the attempts of one request; shared by all requests of one app."""

    def __init__(
        self,
        config: RouterConfig,
        fleet: Fleet,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self.session = session

    async def forward(
        self,
        body: dict[str, Any],
        route: str,
        base: RoutingRequest,
        policy: RoutingPolicy,
        authorization: str | None,
        raw: bytes | None = None,
    ) -> Answer | Stream:
        """Route `body` (to `PATHS[route]`) until an engine answers or attempts run out.

        `raw` is the client's body as it came: a decode-only or colocated request sends exactly
        those bytes; a disaggregated one sends `body` with the router's `kv_transfer_params`.
        """
        headers = self.fleet.engine_headers(authorization)
        stream = body.get("stream") is True
        exclude_d: set[str] = set()
        exclude_p: set[str] = set()
        exclude_pairs: set[tuple[str, str]] = set()
        last: str | None = None
        join_deadline: float | None = None
        attempts = 0
        while attempts < MAX_ATTEMPTS:
            request = replace(
                base,
                exclude_decode=exclude_d,
                exclude_prefill=exclude_p,
                exclude_pairs=exclude_pairs | self.fleet.open_pairs(),
            )
            try:
                decision = policy.decide(self.fleet.snapshots(), request, self.fleet.prefixes)
            except NoEngineAvailable as exc:
                if exc.saturated:
                    return _error(429, f"{exc}; retry later", retry_after_s=1)
                if join_deadline is None:
                    join_deadline = time.monotonic() + self.config.join_wait_s
                joining = self.fleet.joining(DECODE_ROLES, exclude_d)
                if joining and await self.fleet.wait_for_change(join_deadline - time.monotonic()):
                    continue  # decide again: the joining engine may be usable now
                message = str(exc)
                if joining and self.config.join_wait_s > 0:
                    message += (
                        f"; no joining decode engine became usable within "
                        f"{self.config.join_wait_s:g} s"
                    )
                if last is not None:
                    message += f"; the last attempt: {last}"
                return _error(503, message, retry_after_s=1)
            attempts += 1
            self.metrics.decisions.labels(decision.kind, decision.reason).inc()
            kv: dict[str, Any] | None = None
            if decision.prefill_url is not None:
                try:
                    kv = await self._prefill(decision, body, route, headers)
                except _Answered as answered:
                    return answered.answer
                except (_Failed, _Busy) as exc:
                    exclude_p.add(decision.prefill_url)
                    self.metrics.retries.labels("prefill").inc()
                    last = f"prefill on {decision.prefill_url}: {exc}"
                    continue
                self.fleet.prefixes.record(decision.prefill_url, base.block_hashes)
            self.fleet.prefixes.record(decision.decode_url, base.block_hashes)
            decode_body: dict[str, Any] | bytes = (
                {**body, "kv_transfer_params": kv} if kv is not None else raw or body
            )
            try:
                outcome = await self._decode(decision, decode_body, route, headers, stream)
            except (_Failed, _Busy) as exc:
                if decision.prefill_url is not None and isinstance(exc, _Failed):
                    self.fleet.end_pair(decision.prefill_url, decision.decode_url, False)
                    if exc.kind == "status_5xx":
                        exclude_pairs.add((decision.prefill_url, decision.decode_url))
                    else:
                        exclude_d.add(decision.decode_url)
                else:
                    exclude_d.add(decision.decode_url)
                self.metrics.retries.labels("decode").inc()
                last = f"decode on {decision.decode_url}: {exc}"
                continue
            return outcome
        return _error(503, f"no engine answered after {MAX_ATTEMPTS} attempts; the last: {last}", 1)

    # -- the legs ---------------------------------------------------------------------------

    async def _prefill(
        self, decision: Decision, body: dict[str, Any], route: str, headers: dict[str, str]
    ) -> dict[str, Any]:
        url = decision.prefill_url
        assert url is not None
        leg = {**body, "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1,
               "stream": False, "n": 1}  # fmt: skip
        for key in ("stream_options", "min_tokens"):
            leg.pop(key, None)
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        if not self.fleet.begin(url):
            raise _Busy(f"{url}'s breaker allows no request now")
        outcome: bool | None = None
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(
            total=self.config.prefill_timeout_s, connect=self.config.connect_timeout_s
        )
        try:
            try:
                async with self.session.post(
                    url + PATHS[route], json=leg, headers=headers, timeout=timeout
                ) as response:
                    data = await response.read()
                    self.metrics.upstream_latency.labels("prefill").observe(
                        time.monotonic() - started
                    )
                    if response.status in _CLIENT_ERRORS_PASSED_ON:
                        raise _Answered(Answer(response.status, data, _content_type(response)))
                    if response.status == 429:
                        raise _Busy("the prefill engine answered 429")
                    if response.status != 200:
                        outcome = False
                        raise self._failed("prefill", "status_5xx", f"answered {response.status}")
                    try:
                        params = json.loads(data).get("kv_transfer_params")
                    except (ValueError, AttributeError):
                        params = None
                    if not isinstance(params, dict):
                        outcome = False
                        raise self._failed("prefill", "bad_answer", "no kv_transfer_params")
                    outcome = True
            except TimeoutError as exc:
                outcome = False
                raise self._failed("prefill", "timeout", f"timed out: {exc}") from exc
            except aiohttp.ClientError as exc:
                outcome = False
                raise self._failed("prefill", "connection", f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.fleet.end(url, outcome)
        return {**params, "do_remote_prefill": True}

    async def _decode(
        self,
        decision: Decision,
        body: dict[str, Any] | bytes,
        route: str,
        headers: dict[str, str],
        stream: bool,
    ) -> Answer | Stream:
        url = decision.decode_url
        if isinstance(body, bytes):
            payload: dict[str, Any] = {"data": body, "headers": {**headers, **_JSON}}
        else:
            payload = {"json": body, "headers": headers}
        if not self.fleet.begin(url):
            raise _Busy(f"{url}'s breaker allows no request now")
        pair = decision.prefill_url
        role = "unified" if decision.kind == "colocated" else "decode"
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.config.connect_timeout_s,
            sock_read=self.config.read_timeout_s if stream else None,
        )
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self.config.first_byte_timeout_s):
                response = await self.session.post(url + PATHS[route], timeout=timeout, **payload)
                self.metrics.upstream_latency.labels(role).observe(time.monotonic() - started)
                if response.status == 200 and stream:
                    head, error = await _first_token_events(response)
                    if error is None:
                        return Stream(response, lambda ok: self._finish(url, pair, ok), head)
                    response.close()
                    kind = "status_5xx" if error.get("code") == KV_TRANSFER_FAILED else "stream"
                    self.fleet.end(url, False if pair is None or kind != "status_5xx" else None)
                    raise self._failed(role, kind, f"failed before its first token: {error}")
                data = await _read_body(response)
        except TimeoutError as exc:
            self._close(response, url, False)
            raise self._failed(role, "timeout", "timed out before its answer") from exc
        except aiohttp.ClientError as exc:
            self._close(response, url, False)
            raise self._failed(role, "connection", f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            self._close(response, url, None)
            raise
        assert response is not None
        response.release()
        status = response.status
        if status == 200:
            self._finish(url, pair, True)
            return Answer(200, data, _content_type(response))
        if status == 429:
            self.fleet.end(url, None)
            raise _Busy("the decode engine answered 429")
        if status in _CLIENT_ERRORS_PASSED_ON:
            self.fleet.end(url, None)
            return Answer(status, data, _content_type(response))
        # A 5xx after a remote prefill is laid on the pair, not the engine (see the docstring).
        self.fleet.end(url, False if pair is None else None)
        raise self._failed(role, "status_5xx", f"answered {status}")

    def _finish(self, url: str, prefill: str | None, outcome: bool | None) -> None:
        self.fleet.end(url, outcome)
        if prefill is not None:
            self.fleet.end_pair(prefill, url, outcome)

    def _close(
        self, response: aiohttp.ClientResponse | None, url: str, outcome: bool | None
    ) -> None:
        if response is not None:
            response.close()
        self.fleet.end(url, outcome)

    def _failed(self, role: str, kind: str, message: str) -> _Failed:
        self.metrics.upstream_errors.labels(role, kind).inc()
        return _Failed(kind, message)


class _Answered(Exception):
    """A leg's answer goes to the client as it is (a client error)."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.status)
        self.answer = answer


async def _first_token_events(
    response: aiohttp.ClientResponse,
) -> tuple[bytes, dict[str, Any] | None]:
    """Read a streamed answer up to its first event that carries output (at most
    `MAX_HELD_EVENTS` events or `MAX_HELD_BYTES`): the bytes read (possibly ending inside an
    event; the caller sends them first and streams the rest), and the error if the engine
    failed before its first token (e.g. `kv_transfer_failed`: the KV load happens before the
    first token). Nothing has reached the client yet, so such a failure is still retried."""
    head = b""
    scanned = 0
    events = 0
    while len(head) <= MAX_HELD_BYTES:
        chunk = await response.content.readany()
        if not chunk:
            break
        head += chunk
        while (end := head.find(b"\n\n", scanned)) >= 0:
            data = head[scanned:end].strip().removeprefix(b"data: ")
            scanned = end + 2
            events += 1
            try:
                payload = json.loads(data)
            except ValueError:  # [DONE], a comment or no JSON: nothing to hold back for
                return head, None
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                return head, payload["error"]
            if not _is_preamble(payload) or events >= MAX_HELD_EVENTS:
                return head, None
    return head, None


def _is_preamble(payload: Any) -> bool:
    """A chat chunk that carries no output yet (the assistant's role only)."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not choices or not isinstance(choices, list):
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") or choice.get("token_ids"):
            return False
        if any(value for key, value in delta.items() if key != "role"):
            return False
    return True


async def _read_body(response: aiohttp.ClientResponse) -> bytes:
    """The whole answer body, at most `MAX_BODY_BYTES` (an engine's answer is bounded by its
    max_tokens; a larger one is a broken engine).

    Raises:
        aiohttp.ClientPayloadError: the body is larger than `MAX_BODY_BYTES`.
    """
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise aiohttp.ClientPayloadError(f"the answer exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _content_type(response: aiohttp.ClientResponse) -> str:
    return response.headers.get("Content-Type", "application/json")
