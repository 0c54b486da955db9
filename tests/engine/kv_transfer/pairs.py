"""Shared helpers of the transport tests: a local transport in the test process paired with a
peer engine in another process, random block copies and the check that they landed. A helper
module, not the conftest, so test modules import it by name (the conftest holds the fixtures)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from fleetserve.engine.kv_transfer.transport import BlockCopy, KVTransport, kv_region_name
from tests.engine.kv_transfer.peer import Peer, build_transport, random_kv

KINDS = ["tcp", "tcp-shm", "mooncake"]


@dataclass
class Pair:
    kind: str
    local: KVTransport
    caches: list[torch.Tensor]
    peer: Peer


def transport_kind(kind: str) -> str:
    return "mooncake" if kind == "mooncake" else "tcp"


def make_local(kind: str, engine_id: str = "local", **options) -> KVTransport:
    if kind == "tcp":
        options.setdefault("config", {})["same_host"] = False
    return build_transport(transport_kind(kind), engine_id, options)


def start_pair(kind: str, *, local_options=None, peer_options=None, layers=3, num_blocks=24):
    peer = Peer.start(
        transport_kind(kind),
        layers=layers,
        num_blocks=num_blocks,
        shared=kind == "tcp-shm",
        options=peer_options,
    )
    local = make_local(kind, **(local_options or {}))
    caches, _ = random_kv(layers, num_blocks + 8, seed=2)
    local.register_kv_caches(caches)
    return Pair(kind, local, caches, peer)


def stop_pair(pair: Pair) -> None:
    pair.local.close()
    pair.peer.stop()


def random_copies(
    rng: random.Random, layers: range, src_blocks: int, dst_blocks: int, count: int
) -> list[BlockCopy]:
    """Per region the same mix: a few runs consecutive on both sides plus scattered ids."""
    copies = []
    for layer in layers:
        for kind in "kv":
            src = rng.sample(range(src_blocks), count)
            dst = rng.sample(range(dst_blocks), count)
            # Make the first half runs: consecutive on both sides.
            run = count // 2
            s0, d0 = rng.randrange(src_blocks - run), rng.randrange(dst_blocks - run)
            src_run, dst_run = list(range(s0, s0 + run)), list(range(d0, d0 + run))
            rest = [
                (s, d)
                for s, d in zip(src, dst, strict=True)
                if s not in src_run and d not in dst_run
            ][: count - run]
            copies.append(
                BlockCopy(
                    kv_region_name(layer, kind),
                    src_run + [s for s, _ in rest],
                    dst_run + [d for _, d in rest],
                )
            )
    return copies


def assert_copied(before, after, sources, copies: list[BlockCopy]) -> None:
    """Every destination block holds its source's bytes; every other block is unchanged."""
    for layer, (old, new, src) in enumerate(zip(before, after, sources, strict=True)):
        for index, kind in enumerate("kv"):
            expected = old[index].clone()
            for copy in copies:
                if copy.region == kv_region_name(layer, kind):
                    for s, d in zip(copy.src_block_ids, copy.dst_block_ids, strict=True):
                        expected[d] = src[index][s]
            assert torch.equal(new[index], expected), f"layer {layer} {kind} differs"
