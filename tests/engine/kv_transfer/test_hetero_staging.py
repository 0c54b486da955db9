"""A pull into a local region named differently from the peer's (`BlockCopy.local_region`: the
staging buffers a consumer rank reads another TP size's blocks into) moves exactly the peer's
blocks there, over every transport path (sockets, the same-host shared-memory path, Mooncake),
and leaves the region of the peer's name untouched."""

from __future__ import annotations

import random

import pytest
import torch

from fleetserve.engine.kv_transfer.transport import BlockCopy, TransferState, kv_region_name
from tests.engine.kv_transfer.pairs import Pair
from tests.engine.kv_transfer.peer import BLOCK_SHAPE, DTYPE


def test_pull_into_a_staging_region_is_exact(pair: Pair) -> None:
    rng = random.Random(16)
    sources = pair.peer.caches()
    # A staging buffer of the peer's block shape, registered after the KV caches (as the
    # worker role does on the first heterogeneous pull).
    stage = torch.zeros((2, 12, *BLOCK_SHAPE), dtype=DTYPE)
    name = f"stage.{pair.kind}."
    for index, kind in enumerate("kv"):
        pair.local.register_region(f"{name}{kv_region_name(1, kind)}", stage[index], layer=1)
    src, dst = rng.sample(range(24), 6), rng.sample(range(12), 6)
    copies = [
        BlockCopy(
            kv_region_name(1, kind), src, dst, local_region=f"{name}{kv_region_name(1, kind)}"
        )
        for kind in "kv"
    ]
    before = [c.clone() for c in pair.caches]
    status = pair.local.pull(pair.peer.descriptor, copies, timeout=10).wait(15)
    assert status.state is TransferState.DONE, status.failure
    for index in range(2):
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(stage[index][d], sources[1][index][s])
        untouched = [b for b in range(12) if b not in dst]
        assert not stage[index][untouched].any()
    for old, new in zip(before, pair.caches, strict=True):
        assert torch.equal(old, new), "the cache region of the peer's name changed"


def test_a_staging_region_of_another_block_size_is_refused(pair: Pair) -> None:
    small = torch.zeros((2, 4, 2, *BLOCK_SHAPE[1:]), dtype=DTYPE)
    pair.local.register_region(f"small.{pair.kind}.k", small[0], layer=0)
    copy = BlockCopy(kv_region_name(0, "k"), [0], [0], local_region=f"small.{pair.kind}.k")
    with pytest.raises(ValueError, match="local blocks are 64 B"):
        pair.local.pull(pair.peer.descriptor, [copy], timeout=10)
