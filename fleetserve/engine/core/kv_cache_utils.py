"""The engine side of prefix-cache hashing: an incremental hasher for `Request`s.

The hash itself (chained sha256 with a fixed seed, salt on block 0) is `fleetserve.common.block_hash`,
shared with the router so that both compute the same hashes for the same prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fleetserve.common.block_hash import BlockHash, hash_token_blocks

if TYPE_CHECKING:
    from fleetserve.engine.request import Request

__all__ = ["get_request_block_hasher"]


def get_request_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """Return an incremental hasher for `Request(block_hasher=...)`.

    The hasher resumes after the blocks already in `request.block_hashes`, hashes only blocks that
    are full, and returns the new hashes (empty when no block completed); see
    `hash_token_blocks` for the salt rule.

    Raises:
        ValueError: if block_size is not positive.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")

    def hasher(request: Request) -> list[BlockHash]:
        num_hashed = len(request.block_hashes)
        if len(request.all_token_ids) < (num_hashed + 1) * block_size:
            # NOTE: what hash_token_blocks returns here, without its call: a decode step
            # appends a token to every request, and block_size - 1 of block_size complete none.
            return []
        return hash_token_blocks(
            request.all_token_ids,
            block_size,
            cache_salt=request.cache_salt,
            parent=request.block_hashes[-1] if request.block_hashes else None,
            first_block=num_hashed,
            lora_name=None if request.lora_request is None else request.lora_request.lora_name,
        )

    return hasher
