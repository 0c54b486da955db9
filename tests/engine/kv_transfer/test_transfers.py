"""Pull and push between two real processes on loopback, for tcp, tcp same-host and mooncake."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from fleetserve.engine.kv_transfer.transport import BlockCopy, TransferState, kv_region_name
from tests.engine.kv_transfer.pairs import (
    Pair,
    assert_copied,
    random_copies,
    start_pair,
    stop_pair,
)


def test_pull_random_blocks_is_exact_and_touches_nothing_else(pair: Pair) -> None:
    rng = random.Random(7)
    sources = pair.peer.caches()
    for _ in range(3):
        copies = random_copies(rng, range(3), src_blocks=24, dst_blocks=32, count=8)
        before = [c.clone() for c in pair.caches]
        status = pair.local.pull(pair.peer.descriptor, copies, timeout=10).wait(15)
        assert status.state is TransferState.DONE, status.failure
        assert status.same_host is (pair.kind == "tcp-shm")
        assert status.layers_done == {0, 1, 2}
        assert status.bytes_done == status.total_bytes == 3 * 2 * 8 * 128
        # 4 consecutive blocks coalesce into one descriptor per region; 4 scattered ones stay.
        assert status.num_descriptors <= 3 * 2 * 5
        assert_copied(before, pair.caches, sources, copies)


def test_push_random_blocks_is_exact_and_touches_nothing_else(pair: Pair) -> None:
    rng = random.Random(8)
    for round_ in range(3):
        copies = random_copies(rng, range(3), src_blocks=32, dst_blocks=24, count=8)
        before = pair.peer.caches()
        tag = f"req-{pair.kind}-{round_}"
        status = pair.local.push(pair.peer.descriptor, copies, tag=tag, timeout=10).wait(15)
        assert status.state is TransferState.DONE, status.failure
        assert status.same_host is (pair.kind == "tcp-shm")
        assert_copied(before, pair.peer.caches(), pair.caches, copies)
        # Every layer was announced on the peer once its bytes had landed.
        notes = pair.peer.call("notifications")
        assert sorted(layer for t, layer in notes if t == tag) == [0, 1, 2]


def test_empty_and_single_block_transfers(pair: Pair) -> None:
    empty = pair.local.pull(pair.peer.descriptor, []).wait(5)
    assert empty.state is TransferState.DONE and empty.layers == frozenset()
    one = [BlockCopy("layer.1.v", [23], [0])]
    assert pair.local.pull(pair.peer.descriptor, one).wait(5).state is TransferState.DONE
    assert torch.equal(pair.caches[1][1, 0], pair.peer.caches()[1][1, 23])


@pytest.mark.slow
def test_layers_complete_in_order_and_can_be_awaited_one_by_one() -> None:
    # One lane (one worker): layer L's blocks are requested only after layer L-1's, so a
    # consumer waiting for layer 0 proceeds while later layers are still moving.
    for kind, options in [
        ("tcp", {"config": {"lanes_per_peer": 1}}),
        ("tcp-shm", {"config": {"lanes_per_peer": 1}}),
        ("mooncake", {"workers": 1}),
    ]:
        pair = start_pair(kind, local_options=options, layers=8, num_blocks=16384)
        try:
            copies = [
                BlockCopy(kv_region_name(layer, k), range(16384), range(16384))
                for layer in range(8)
                for k in "kv"
            ]
            ahead = 0  # rounds where layer 0 was usable while later layers still moved
            for _ in range(5):
                handle = pair.local.pull(pair.peer.descriptor, copies, timeout=20)
                assert handle.wait_layer(0, timeout=20) is TransferState.DONE
                seen = [handle.poll().layers_done]
                ahead += seen[0] != frozenset(range(8))
                while (status := handle.poll()).state is TransferState.PENDING:
                    if status.layers_done != seen[-1]:
                        seen.append(status.layers_done)
                    time.sleep(0.0001)  # let the lane take the GIL to mark layers done
                assert status.state is TransferState.DONE, status.failure
                for layers_done in seen:  # always a prefix: 0..k, in order
                    assert layers_done == frozenset(range(len(layers_done))), (kind, seen)
                assert handle.wait_layer(7, timeout=1) is TransferState.DONE
            assert ahead, f"{kind}: layer 0 never finished before the last layer"
        finally:
            stop_pair(pair)


@pytest.mark.slow
def test_many_transfers_in_flight_respect_admission_bounds() -> None:
    bounds = {
        "tcp": {
            "config": {
                "max_inflight_tasks": 3,
                "max_inflight_bytes": 2048,
                "chunk_bytes": 1024,
                "same_host_chunk_bytes": 1024,
            }
        },
        "mooncake": {"max_inflight_tasks": 3, "max_inflight_bytes": 2048},
    }
    for kind in ("tcp", "tcp-shm", "mooncake"):
        options = bounds["mooncake" if kind == "mooncake" else "tcp"]
        pair = start_pair(kind, local_options=options)
        try:
            sources = pair.peer.caches()
            rng = random.Random(3)
            handles, expected = [], []
            for i in range(40):
                layer, region = i % 3, "kv"[i % 2]
                src = rng.sample(range(24), 4)
                dst = [4 * (i // 6) + j for j in range(4)]  # disjoint destinations per transfer
                copy = BlockCopy(kv_region_name(layer, region), src, dst)
                expected.append(copy)
                handles.append(pair.local.pull(pair.peer.descriptor, [copy], timeout=20))
            statuses = [h.wait(30) for h in handles]
            assert all(s.state is TransferState.DONE for s in statuses), [
                s.failure for s in statuses if s.failure
            ]
            stats = pair.local.stats()
            assert 1 <= stats.peak_inflight_tasks <= 3
            assert stats.peak_inflight_bytes <= 2048
            assert stats.inflight_tasks == 0 and stats.inflight_bytes == 0
            for copy in expected:  # destinations are disjoint per region
                layer, region = int(copy.region.split(".")[1]), "kv".index(copy.region[-1])
                for s, d in zip(copy.src_block_ids, copy.dst_block_ids, strict=True):
                    assert torch.equal(pair.caches[layer][region, d], sources[layer][region, s])
        finally:
            stop_pair(pair)


def test_concurrent_callers_on_threads(pair: Pair) -> None:
    sources = pair.peer.caches()
    errors: list[object] = []

    def worker(layer: int) -> None:
        for i in range(10):
            copy = [BlockCopy(kv_region_name(layer, "k"), [i, i + 1], [20 + i % 4, 25 + i % 4])]
            status = pair.local.pull(pair.peer.descriptor, copy, timeout=10).wait(15)
            if status.state is not TransferState.DONE:
                errors.append(status.failure)
            elif not torch.equal(pair.caches[layer][0, 25 + i % 4], sources[layer][0, i + 1]):
                errors.append(f"layer {layer} round {i}: wrong bytes")

    threads = [threading.Thread(target=worker, args=(layer,)) for layer in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
