"""The prompt's token ids and block hashes, for the policy.

Tokenization is the engines' own: the router asks an engine's `POST /tokenize` (the same
tokenizer and chat template the engine will apply), so the block hashes it computes with
`fleetserve.common.block_hash` are the engine's exactly. A local tokenizer would save the round
trip (~1 ms on loopback), but it would have to reproduce the engine's chat-template rendering
and special-token handling, and a silent mismatch only shows as lost cache hits; the engine's
endpoint cannot drift. Token-id prompts are hashed without any call. When the policy needs no
tokens (prefix-awareness off and mode not selective) nothing is tokenized at all.

A failed tokenization never fails the request: the policy then routes without prefix
information (the engine will answer the request's own errors).
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from fleetserve.common.block_hash import hash_token_blocks
from fleetserve.router.policy import RoutingRequest

__all__ = ["prompt_request", "single_prompt"]

logger = logging.getLogger(__name__)


def single_prompt(
    body: dict[str, Any], route: str
) -> tuple[bool, dict[str, Any] | None, list[int] | None]:
    """Whether the request carries one prompt (P/D can carry it), the `/tokenize` body for it
    (None: nothing to tokenize), and its token ids when the client gave them (completions)."""
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return True, None, None
        add = body.get("add_generation_prompt", True)
        return True, {"messages": messages, "add_generation_prompt": add}, None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return True, {"prompt": prompt}, None
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        # Token ids the engine would refuse (negative, bool) are not hashed: no prefix claim.
        valid = bool(prompt) and all(type(t) is int and t >= 0 for t in prompt)
        return True, None, list(prompt) if valid else None
    return False, None, None


async def prompt_request(
    session: aiohttp.ClientSession,
    body: dict[str, Any],
    route: str,
    *,
    tokenize_url: str | None,
    headers: dict[str, str],
    block_size: int,
    needs_tokens: bool,
    timeout_s: float,
    adapter: str | None = None,
) -> RoutingRequest:
    """The `RoutingRequest` for `body` (a completions or chat body), tokenizing on the engine at
    `tokenize_url` when needed and possible; `adapter` is the LoRA adapter its `model` names
    (its block hashes then carry the name, as the engine's do)."""
    disaggregable, tokenize_body, ids = single_prompt(body, route)
    if not needs_tokens or not disaggregable:
        return RoutingRequest(disaggregable=disaggregable, adapter=adapter)
    if ids is None and tokenize_body is not None and tokenize_url is not None:
        if isinstance(body.get("model"), str):
            tokenize_body["model"] = body["model"]
        try:
            async with session.post(
                f"{tokenize_url}/tokenize",
                json=tokenize_body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                if response.status == 200:
                    tokens = (await response.json()).get("tokens")
                    if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                        ids = tokens
                else:
                    logger.debug("tokenize on %s answered %s", tokenize_url, response.status)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.debug("tokenize on %s failed: %s", tokenize_url, exc)
    if ids is None:
        return RoutingRequest(disaggregable=disaggregable, adapter=adapter)
    salt = body.get("cache_salt")
    hashes = hash_token_blocks(
        ids, block_size, cache_salt=salt if isinstance(salt, str) else None, lora_name=adapter
    )
    return RoutingRequest(
        block_hashes=hashes,
        num_prompt_tokens=len(ids),
        disaggregable=disaggregable,
        adapter=adapter,
    )
