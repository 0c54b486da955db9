"""The same-host path: shared-memory arenas, their cleanup, choosing the path and falling back."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import random
from pathlib import Path

import pytest
import torch

from fleetserve.engine.kv_transfer.transport import (
    BlockCopy,
    SharedKVArena,
    TransferState,
    host_identity,
)
from fleetserve.engine.kv_transfer.transport.shm import PeerArena
from tests.engine.kv_transfer.pairs import (
    KINDS,
    Pair,
    assert_copied,
    make_local,
    random_copies,
    start_pair,
    stop_pair,
)
from tests.engine.kv_transfer.peer import Peer, random_kv


def test_arena_tensors_share_one_file_that_close_unlinks() -> None:
    arena = SharedKVArena.create([(2, 5, 4, 2, 8)] * 3, torch.bfloat16)
    try:
        assert arena.path.parent == Path("/dev/shm") and arena.path.exists()
        assert [tuple(t.shape) for t in arena.tensors] == [(2, 5, 4, 2, 8)] * 3
        assert all(
            t.is_contiguous() and t.dtype == torch.bfloat16 and not t.any() for t in arena.tensors
        )
        arena.tensors[1][1, 4] = 3.5
        # Another mapping of the file (what a same-host peer does) sees the same bytes.
        peer = PeerArena.open(str(arena.path), arena.arena_id, arena.size)
        offset = arena.offset_of(arena.tensors[1][1, 4].data_ptr())
        value = torch.empty(2, dtype=torch.bfloat16)
        ctypes.memmove(value.data_ptr(), peer.base_ptr + offset, 4)
        assert value.tolist() == [3.5, 3.5]
        with pytest.raises(ValueError, match="is not arena"):
            PeerArena.open(str(arena.path), "0" * 16, arena.size)
    finally:
        arena.close()
    assert not arena.path.exists()
    arena.tensors[0].fill_(1)  # still mapped: usable until dropped


def test_arenas_of_killed_processes_are_swept() -> None:
    peer = Peer.start("tcp", shared=True)
    path = Path(peer.call("arena_path"))
    assert path.exists() and str(os.getpid()) not in path.name
    peer.kill()
    assert path.exists()  # SIGKILL leaves it behind ...
    SharedKVArena.create([(1, 1)], torch.uint8).close()
    assert not path.exists()  # ... until the next arena is created on this host


def test_peers_on_this_machine_share_a_host_identity() -> None:
    peer = Peer.start("tcp")
    try:
        assert peer.descriptor.host_identity == host_identity()
    finally:
        peer.stop()


@pytest.fixture(scope="module")
def shm_pair():
    pair = start_pair("tcp-shm")
    yield pair
    stop_pair(pair)


def test_same_host_path_is_chosen_only_when_it_can_be(shm_pair: Pair) -> None:
    copies = [BlockCopy("layer.0.k", [1, 2, 3], [4, 5, 6])]
    peer = shm_pair.peer.descriptor
    assert shm_pair.local.pull(peer, copies).wait(10).same_host
    other_host = dataclasses.replace(peer, host_identity="elsewhere")
    status = shm_pair.local.pull(other_host, copies).wait(10)
    assert status.state is TransferState.DONE and not status.same_host
    off = make_local("tcp", engine_id="no-shm")
    try:
        off.register_kv_caches(random_kv(3, 32, seed=4)[0])
        assert not off.pull(peer, copies).wait(10).same_host
    finally:
        off.close()


def test_an_unmappable_arena_falls_back_to_tcp_for_good() -> None:
    pair = start_pair("tcp-shm")
    try:
        peer = pair.peer.descriptor
        files = [dict(f, path="/dev/shm/fleetserve-kv-missing") for f in peer.extra["shm_files"]]
        broken = dataclasses.replace(peer, extra={**peer.extra, "shm_files": files})
        sources = pair.peer.caches()
        copies = random_copies(random.Random(1), range(3), 24, 32, 6)
        before = [c.clone() for c in pair.caches]
        status = pair.local.pull(broken, copies).wait(10)
        assert status.state is TransferState.DONE and not status.same_host
        assert_copied(before, pair.caches, sources, copies)
        assert not pair.local.pull(peer, copies).wait(10).same_host  # the link remembers
    finally:
        stop_pair(pair)


@pytest.mark.parametrize("kind", KINDS)
def test_interleaved_layout_moves_the_right_bytes(kind: str) -> None:
    """Blocks at base + id * stride with stride = 2 blocks (keys and values interleaved)."""
    peer = Peer.start(
        "mooncake" if kind == "mooncake" else "tcp", shared=kind == "tcp-shm", interleaved=True
    )
    local = make_local(kind)
    caches, _ = random_kv(3, 32, seed=2)
    local.register_kv_caches(caches)
    try:
        assert peer.descriptor.regions[0].block_stride == 2 * peer.descriptor.regions[0].block_bytes
        rng = random.Random(5)
        copies = random_copies(rng, range(3), 24, 32, 6)
        sources, before = peer.caches(), [c.clone() for c in caches]
        status = local.pull(peer.descriptor, copies).wait(10)
        assert status.state is TransferState.DONE, status.failure
        assert status.num_descriptors == 3 * 2 * 6  # strided: nothing coalesces
        assert_copied(before, caches, sources, copies)
        copies = random_copies(rng, range(3), 32, 24, 6)
        before = peer.caches()
        assert local.push(peer.descriptor, copies, tag="x").wait(10).state is TransferState.DONE
        assert_copied(before, peer.caches(), caches, copies)
    finally:
        local.close()
        peer.stop()
