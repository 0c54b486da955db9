"""`kv_transfer_params`: what a request carries between a prefill and a decode engine.

The protocol is vLLM's disaggregated-serving one, so routers and engines can be mixed:

- to the producer (prefill engine): `{"do_remote_decode": true}`, optionally with a
  `transfer_id` the router chose (so it can dispatch the decode leg at the same time, which push
  mode turns into layer-by-layer overlap). The producer computes the prompt, keeps its blocks under
  a lease and answers with the consumer's parameters below.
- to the consumer (decode engine): `{"do_remote_prefill": true, "remote_engine_id",
  "remote_host", "remote_port", "remote_request_id", "remote_block_ids", ...}`: where the
  producer's control channel is, which request's blocks to take, and (pull mode) which blocks.
  In push mode `remote_block_ids` may be absent: the consumer tells the producer its own blocks
  and the producer writes into them.

Parsing is strict: an unknown key, a wrong type or both directions at once is a `ValueError`
naming the key, which the HTTP layer answers with a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ConsumerParams", "ProducerParams", "parse_kv_transfer_params"]


_COMMON_KEYS = {"do_remote_decode", "do_remote_prefill"}
_PRODUCER_KEYS = {"transfer_id"}
_CONSUMER_KEYS = {
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_block_ids",
    "remote_num_tokens",
    "compatibility_hash",
    "transfer_id",
    # vLLM's producers also send these; accepted so their responses can be passed through.
    "tp_size",
    "remote_dp_rank",
}


@dataclass(frozen=True, slots=True)
class ProducerParams:
    """A prefill request: compute the prompt and keep its KV for a consumer."""

    transfer_id: str | None = None
    """The key the consumer will name (the router's choice), else the engine's request id."""


@dataclass(frozen=True, slots=True)
class ConsumerParams:
    """A decode request: take the prompt's KV from the producer named here."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    """The producer's key for the request's blocks (its transfer id)."""
    remote_block_ids: tuple[int, ...] | None = None
    """The producer's block ids in prompt order (pull mode); None in push mode."""
    remote_num_tokens: int | None = None
    """Prompt tokens whose KV the producer holds (defaults to the whole prompt)."""
    compatibility_hash: str | None = None
    """The producer's hash; checked again at handshake."""

    def to_dict(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_request_id": self.remote_request_id,
        }
        if self.remote_block_ids is not None:
            params["remote_block_ids"] = list(self.remote_block_ids)
        if self.remote_num_tokens is not None:
            params["remote_num_tokens"] = self.remote_num_tokens
        if self.compatibility_hash is not None:
            params["compatibility_hash"] = self.compatibility_hash
        return params


def _require(cond: bool, key: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"kv_transfer_params.{key} must be {allowed}, got {value!r}")


def parse_kv_transfer_params(
    params: dict[str, Any] | None,
) -> ProducerParams | ConsumerParams | None:
    """The role a request's `kv_transfer_params` asks for, or None for an ordinary request.

    Raises:
        ValueError: unknown keys, wrong types, or both directions at once (the key is named).
    """
    if not params:
        return None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    decode, prefill = params.get("do_remote_decode", False), params.get("do_remote_prefill", False)
    _require(isinstance(decode, bool), "do_remote_decode", "a boolean", decode)
    _require(isinstance(prefill, bool), "do_remote_prefill", "a boolean", prefill)
    if decode and prefill:
        raise ValueError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive "
            "(a request is either the prefill leg or the decode leg)"
        )
    if not decode and not prefill:
        unknown = sorted(set(params) - _COMMON_KEYS - _PRODUCER_KEYS - _CONSUMER_KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_params has unknown keys {unknown}")
        return None
    allowed = _COMMON_KEYS | (_PRODUCER_KEYS if decode else _CONSUMER_KEYS)
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(
            f"kv_transfer_params has unknown keys {unknown}; allowed: {sorted(allowed)}"
        )
    if decode:
        transfer_id = params.get("transfer_id")
        _require(transfer_id is None or (isinstance(transfer_id, str) and transfer_id != ""),
                 "transfer_id", "a non-empty string", transfer_id)  # fmt: skip
        return ProducerParams(transfer_id=transfer_id)
    for key in ("remote_engine_id", "remote_host", "remote_request_id"):
        value = params.get(key)
        _require(isinstance(value, str) and value != "", key, "a non-empty string", value)
    port = params.get("remote_port")
    _require(isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536,
             "remote_port", "a TCP port", port)  # fmt: skip
    assert isinstance(port, int)  # for the type checker: checked just above
    block_ids = params.get("remote_block_ids")
    if block_ids is not None:
        _require(
            isinstance(block_ids, list)
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_ids),
            "remote_block_ids",
            "a list of positive block ids",
            block_ids,
        )
    num_tokens = params.get("remote_num_tokens")
    _require(num_tokens is None or (isinstance(num_tokens, int) and num_tokens > 0),
             "remote_num_tokens", "a positive integer", num_tokens)  # fmt: skip
    compat = params.get("compatibility_hash")
    _require(compat is None or isinstance(compat, str), "compatibility_hash", "a string", compat)
    return ConsumerParams(
        remote_engine_id=params["remote_engine_id"],
        remote_host=params["remote_host"],
        remote_port=port,
        remote_request_id=params["remote_request_id"],
        remote_block_ids=None if block_ids is None else tuple(block_ids),
        remote_num_tokens=num_tokens,
        compatibility_hash=compat,
    )
