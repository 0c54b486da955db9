"""Block hashing: chaining, incremental hashing, salts and cross-process stability."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetserve.common.block_hash import NONE_HASH, hash_block_tokens, hash_token_blocks
from fleetserve.engine.core.kv_cache_utils import get_request_block_hasher
from tests.factories import make_request

PROMPT = list(range(100, 150))  # 50 tokens: 3 full blocks of 16 + 2 tokens


def test_none_hash_is_fixed_sha256_seed() -> None:
    assert hashlib.sha256(b"fleetserve-none-hash").digest() == NONE_HASH
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(NONE_HASH, [1, 2])


def test_shared_prefix_gives_equal_hashes_until_the_first_difference() -> None:
    a = make_request("a", PROMPT + [7] * 14)
    b = make_request("b", PROMPT[:48] + [9] * 16)
    assert len(a.block_hashes) == 4 and len(b.block_hashes) == 4
    assert a.block_hashes[:3] == b.block_hashes[:3]
    assert a.block_hashes[3] != b.block_hashes[3]


def test_same_block_at_another_position_hashes_differently() -> None:
    block = list(range(16))
    r = make_request("r", block + block)
    assert r.block_hashes[0] != r.block_hashes[1]
    assert r.block_hashes[1] == hash_block_tokens(r.block_hashes[0], block)


def test_hasher_is_incremental_and_only_hashes_full_blocks() -> None:
    r = make_request("r", PROMPT)
    assert len(r.block_hashes) == 3
    before = list(r.block_hashes)
    hasher = get_request_block_hasher(16)
    assert hasher(r) == []  # nothing new: idempotent
    r.append_output_token_ids(list(range(13)))  # 63 tokens: still 3 full blocks
    assert r.block_hashes == before
    r.append_output_token_ids([0])  # 64 tokens: the 4th block fills
    assert len(r.block_hashes) == 4 and r.block_hashes[:3] == before
    expected = hash_block_tokens(before[2], r.all_token_ids[48:64])
    assert r.block_hashes[3] == expected


def test_cache_salt_changes_every_hash_and_only_block_zero_carries_it() -> None:
    plain = make_request("p", PROMPT)
    salted = make_request("s", PROMPT, cache_salt="tenant-a")
    other = make_request("o", PROMPT, cache_salt="tenant-b")
    same = make_request("t", PROMPT, cache_salt="tenant-a")
    assert salted.block_hashes == same.block_hashes
    for i in range(3):
        assert len({plain.block_hashes[i], salted.block_hashes[i], other.block_hashes[i]}) == 3
    assert salted.block_hashes[0] == hash_block_tokens(None, PROMPT[:16], ("salt", "tenant-a"))
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], PROMPT[16:32])


def test_extra_keys_are_part_of_the_hash() -> None:
    base = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(None, [1, 2, 3], ("lora-a",)) != base
    assert hash_block_tokens(None, [1, 2, 3], ("lora-a",)) != hash_block_tokens(
        None, [1, 2, 3], ("lora-b",)
    )
    # Type tags keep "1" and 1 apart.
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    with pytest.raises(ValueError, match="extra_keys"):
        hash_block_tokens(None, [1], (object(),))


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        get_request_block_hasher(0)


def test_hashes_are_stable_across_processes() -> None:
    code = (
        "from tests.factories import make_request\n"
        "r = make_request('x', list(range(100, 150)), cache_salt='s')\n"
        "print(','.join(h.hex() for h in r.block_hashes))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=Path(__file__).resolve().parents[3],
    )
    local = make_request("y", PROMPT, cache_salt="s")
    assert result.stdout.strip() == ",".join(h.hex() for h in local.block_hashes)


def test_the_router_side_hash_of_a_prompt_equals_the_engines() -> None:
    # A prefix-aware router hashes the prompt alone with the shared function; the engine hashes
    # the request incrementally as its tokens arrive. Both must agree block for block.
    request = make_request("a", PROMPT[:20], cache_salt="tenant")
    request.append_output_token_ids(PROMPT[20:40])
    request.append_output_token_ids(PROMPT[40:])
    assert request.block_hashes == hash_token_blocks(PROMPT, 16, cache_salt="tenant")
    assert request.block_hashes != hash_token_blocks(PROMPT, 16)
