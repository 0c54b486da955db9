"""Prefix-cache block hashing, shared by the engine and the router (torch-free, stdlib only).

Only full blocks are hashed. Each hash covers its parent's hash, the block's token ids and optional
extra keys, so one hash fingerprints the whole prefix up to and including its block: two requests
share block i's hash only if they share every token before the end of block i (and the same extra
keys). The longest-prefix lookup can therefore stop at the first missing hash.

The hash is sha256 over a deterministic byte encoding, and the root parent (`NONE_HASH`) comes from
a fixed seed. Nothing depends on `PYTHONHASHSEED` or on the process, so every engine process and
every prefill/decode pod computes the same hashes for the same prompt: that is what lets a KV
hand-off between pods, or a prefix-aware router, find the blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

__all__ = ["NONE_HASH", "BlockHash", "hash_block_tokens", "hash_token_blocks"]

BlockHash = NewType("BlockHash", bytes)
"""sha256 digest of one full block (a distinct type so raw bytes are not passed by mistake)."""

_NONE_HASH_SEED = b"fleetserve-none-hash"

NONE_HASH: BlockHash = BlockHash(hashlib.sha256(_NONE_HASH_SEED).digest())
"""Parent of the first block of every request; derived from a fixed seed so all processes agree."""


def _encode_key(key: object, out: list[bytes]) -> None:
    """Append a type-tagged, length-prefixed encoding of one extra key (injective per type).

    Raises:
        ValueError: for a key type without a stable encoding (it would break cross-process
            agreement, e.g. an object whose repr contains its address).
    """
    if key is None:
        out.append(b"N")
    elif isinstance(key, bool):
        out.append(b"T" if key else b"F")
    elif isinstance(key, int):
        text = str(key).encode()
        out.append(b"i" + struct.pack("<I", len(text)) + text)
    elif isinstance(key, str):
        data = key.encode("utf-8")
        out.append(b"s" + struct.pack("<I", len(data)) + data)
    elif isinstance(key, bytes):
        out.append(b"b" + struct.pack("<I", len(key)) + key)
    elif isinstance(key, tuple | list):
        out.append(b"t" + struct.pack("<I", len(key)))
        for item in key:
            _encode_key(item, out)
    else:
        raise ValueError(
            f"extra_keys items must be None, bool, int, str, bytes or tuples of them, "
            f"got {type(key).__name__}"
        )


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Hash one full block, chained on its parent.

    Args:
        parent_block_hash: hash of the previous block, or None for the first block (NONE_HASH).
        token_ids: the block's token ids (non-negative, < 2**63).
        extra_keys: what else distinguishes the block's KV (cache salt, LoRA name, ...), or None.

    Returns:
        The block's 32-byte sha256 digest.
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    parts: list[bytes] = [parent, struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)]
    # NOTE: None and () encode differently on purpose; callers pass None for "no extra keys".
    _encode_key(extra_keys, parts)
    return BlockHash(hashlib.sha256(b"".join(parts)).digest())


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    first_block: int = 0,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `first_block` on, chained on `parent`
    (the hash of block `first_block - 1`, None for the first block).

    The cache salt goes into the extra keys of block 0 only: the chain carries it into every later
    hash, so different salts (tenants) never share a block. A LoRA adapter's name goes first
    into the same extra keys, so the same prompt under two adapters (or an adapter and the base
    model) never shares a block either. A prefix-aware router hashes a prompt
    with this function and gets exactly the engine's hashes.

    Raises:
        ValueError: if block_size is not positive.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    hashes: list[BlockHash] = []
    start = first_block * block_size
    while start + block_size <= len(token_ids):
        extra: tuple[object, ...] | None = None
        if start == 0 and (cache_salt is not None or lora_name is not None):
            lora_key = () if lora_name is None else ("lora", lora_name)
            salt_key = () if cache_salt is None else ("salt", cache_salt)
            extra = lora_key + salt_key
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
        start += block_size
    return hashes
